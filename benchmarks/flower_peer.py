"""Flower's simulation engine on the scale benchmark's task: the peer of ``--scale --peer flower``.

Flower (``flwr``, with Ray for its simulation engine) is an optional extra, ``pip install
'fedfleet[flower]'``; nothing outside this module imports it, and this module imports it only inside the
functions that run Flower, so the benchmarks and their tests load without it.

One size runs in a process of its own (``python -m benchmarks.flower_peer``), so that its whole tree
(the driver with the ServerApp, Ray's GCS and raylet, one client actor per core) is sampled just as
``coordinator emulate``'s tree is (:mod:`benchmarks.process_tree`). The task is :mod:`benchmarks.scale_task`:
the same clients, shards, model (fedfleet's SmallCNN), local work (``train_assignment``), seeds and
evaluation as the FedAvg scale fleet, every client every round, the same number of rounds and the same
round deadline (Flower's ``round_timeout``). A round is timed from ``configure_fit`` to the end of
``aggregate_fit`` (which evaluates the averaged model, as fedfleet's round close does).

    python -m benchmarks.emulation --scale --devices 300 --peer flower --json    (both, side by side)
    python -m benchmarks.flower_peer --devices 20 --rounds 2                      (Flower alone, JSON)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.process_tree import TreeSampler
from benchmarks.scale_fleet import DIGITS, ROUNDS, ScaleData
from benchmarks.scale_task import ScaleTask
from device_agent.emulation.limits import thread_env

_ROOT = Path(__file__).resolve().parents[1]
INSTALL = "pip install 'fedfleet[flower]' (Flower's simulation engine: flwr[simulation], which brings Ray)"


class FlowerMissing(RuntimeError):
    """flwr or ray is not installed."""


def require_flower() -> dict[str, str]:
    """The installed flwr and ray versions; :class:`FlowerMissing` naming the extra when either is absent."""
    try:
        import flwr
        import ray
    except ImportError as error:
        raise FlowerMissing(
            f"--peer flower needs Flower's simulation engine, which is not installed ({error}); "
            f"install the optional extra: {INSTALL}"
        ) from None
    return {"flwr": flwr.__version__, "ray": ray.__version__}


@functools.cache
def _task(devices: int, data: ScaleData, rounds: int, deadline_s: float | None) -> ScaleTask:
    """One per process (a Ray actor serves many clients): the data set loads once, as in a fedfleet worker."""
    return ScaleTask.build(devices, data, rounds, deadline_s)


@functools.cache
def _client_class() -> type:
    from flwr.client import NumPyClient

    class ShardClient(NumPyClient):
        """Device ``index`` of the scale fleet: fedfleet's local round on its shard, nothing else."""

        def __init__(self, task: ScaleTask, index: int) -> None:
            self.task, self.index = task, index

        def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
            arrays, samples = self.task.client_update(self.index, int(config["round"]), parameters)
            return arrays, samples, {}

    return ShardClient


@dataclass(frozen=True)
class ClientFactory:
    """Flower's ``client_fn``: a picklable callable, so Ray's actors rebuild the task from a few numbers."""

    devices: int
    data: ScaleData
    rounds: int
    deadline_s: float | None

    def numpy_client(self, index: int) -> Any:
        """Client ``index`` as a Flower NumPyClient (a test calls its ``fit`` directly, without Ray)."""
        return _client_class()(_task(self.devices, self.data, self.rounds, self.deadline_s), index)

    def __call__(self, context: Any) -> Any:
        torch.set_num_threads(1)  # in a Ray actor of one core, as each emulated agent trains on one thread
        return self.numpy_client(int(context.node_config["partition-id"])).to_client()


def _strategy(task: ScaleTask) -> Any:
    """Flower's own FedAvg (every client every round), timed per round; the close is fedfleet's evaluation."""
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    class TimedFedAvg(FedAvg):
        def __init__(self) -> None:
            super().__init__(
                fraction_fit=1.0,
                fraction_evaluate=0.0,
                min_fit_clients=task.devices,
                min_evaluate_clients=0,
                min_available_clients=task.devices,
                on_fit_config_fn=lambda number: {"round": number},
                initial_parameters=ndarrays_to_parameters(task.global_arrays()),
            )
            self.started: dict[int, float] = {}
            self.rounds: list[dict[str, Any]] = []

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            self.started[server_round] = time.monotonic()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[Any, dict]:
            averaged, _ = super().aggregate_fit(server_round, results, failures)
            accuracy = None
            if averaged is not None:
                arrays, accuracy = task.close_round(parameters_to_ndarrays(averaged))
                averaged = ndarrays_to_parameters(arrays)
            seconds = time.monotonic() - self.started[server_round]
            self.rounds.append(
                {"seconds": seconds, "updates": len(results), "failures": len(failures), "accuracy": accuracy}
            )
            return averaged, {}

    return TimedFedAvg()


def simulate(devices: int, data: ScaleData = DIGITS, rounds: int = ROUNDS, deadline_s: float | None = None) -> dict:
    """Flower's ``run_simulation`` on the task in this process: per-round figures and the versions."""
    versions = require_flower()
    from flwr.client import ClientApp
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.simulation import run_simulation

    task = _task(devices, data, rounds, deadline_s)
    strategy = _strategy(task)
    config = ServerConfig(num_rounds=rounds, round_timeout=task.fleet.round_deadline_s)
    actors = len(os.sched_getaffinity(0))

    def server_fn(_context: Any) -> ServerAppComponents:
        return ServerAppComponents(strategy=strategy, config=config)

    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=ClientFactory(devices, data, rounds, deadline_s)),
        num_supernodes=devices,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": actors}},
    )
    return {"actors": actors, "deadline_seconds": task.fleet.round_deadline_s, "rounds": strategy.rounds, **versions}


def run_size(
    devices: int,
    data: ScaleData = DIGITS,
    rounds: int = ROUNDS,
    deadline_s: float | None = None,
    timeout: float = 1200,
) -> dict:
    """:func:`simulate` in a process of its own, its tree sampled every 0.5 s: the Flower half of one size."""
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-flower-") as folder:
        out, log = Path(folder) / "flower.json", Path(folder) / "flower.log"
        command = [sys.executable, "-m", "benchmarks.flower_peer", "--devices", str(devices), *data.args()]
        command += ["--rounds", str(rounds), "--out", str(out)]
        if deadline_s is not None:
            command += ["--deadline-s", str(deadline_s)]
        env = {**os.environ, **thread_env(1), "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}
        start = time.monotonic()
        with log.open("wb") as sink:
            flower = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=_ROOT)
            tree = TreeSampler(flower.pid)
            try:
                while flower.poll() is None and time.monotonic() - start < timeout:
                    tree.sample()
                    time.sleep(0.5)
            finally:
                if flower.poll() is None:
                    flower.kill()
                flower.wait()
        wall = time.monotonic() - start
        outcome = json.loads(out.read_text()) if out.is_file() else {"rounds": []}
        tail = log.read_text(errors="replace")[-1500:]
    records = outcome["rounds"]
    deadline = outcome.get("deadline_seconds")
    seconds = [r["seconds"] for r in records]
    within = sum(s <= deadline for s in seconds) if deadline else 0
    result = {
        "devices": devices,
        "engine": "flower",
        "flwr": outcome.get("flwr"),
        "ray": outcome.get("ray"),
        "actors": outcome.get("actors"),
        "completed": flower.returncode == 0
        and len(records) == rounds
        and within == rounds
        and all(r["updates"] == devices for r in records),
        "exit_code": flower.returncode,
        "rounds_closed": len(records),
        "updates_per_round": [r["updates"] for r in records],
        "round_seconds": [round(s, 1) for s in seconds],
        "median_round_seconds": round(statistics.median(seconds), 2) if seconds else None,
        "rounds_within_deadline": within,
        "deadline_seconds": deadline,
        "accuracy": [None if r["accuracy"] is None else round(r["accuracy"], 4) for r in records],
        "wall_seconds": round(wall, 1),
        **tree.summary(),
    }
    if not result["completed"]:
        result["log_tail"] = tail
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.flower_peer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, required=True, help="clients (the scale fleet's devices)")
    parser.add_argument("--dataset", default="digits", help="digits (default) or fashion_mnist")
    parser.add_argument(
        "--samples-per-device", type=int, default=0, help="training images per device (default 0: the set split evenly)"
    )
    parser.add_argument("--image-size", type=int, help="images resized to this side (default: the set's own)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds (default: {ROUNDS})")
    parser.add_argument("--deadline-s", type=float, help="round deadline (default: the demo's 60 s)")
    parser.add_argument("--out", type=Path, help="write the JSON here instead of printing it")
    args = parser.parse_args(argv)
    try:
        data = ScaleData(args.dataset, args.samples_per_device or None, args.image_size)
        outcome = simulate(args.devices, data, args.rounds, args.deadline_s)
    except FlowerMissing as error:
        print(error, file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(json.dumps(outcome))
    else:
        print(json.dumps(outcome))
    return 0


if __name__ == "__main__":
    # Ray's actors unpickle the client factory by module name: it must be benchmarks.flower_peer's, not __main__'s.
    from benchmarks.flower_peer import main as _main

    sys.exit(_main())
