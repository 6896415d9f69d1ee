"""How large an emulated fleet one host runs: ``coordinator emulate`` on the demo model at growing sizes.

Each size is a fleet of the demo's three device classes in turn (Jetson Orin Nano 8 GB at gamma 1,
Raspberry Pi 5 capped at 1/2, Pi 4 at 1/4, as examples/demo.yaml), split iid, 3 rounds over the managed
mosquitto, devices packed into workers as ``coordinator emulate`` chooses. The shards come from
Fashion-MNIST by default (Debian's dataset-fashion-mnist), 8 training images per device at 14x14
(:class:`ScaleData`: what 2 cores can train for 1,000 devices within a minute), so the accuracy after each
round says something about learning at that scale; ``--scale-dataset digits`` takes scikit-learn's 1,437
instead (~1 per device at 1,000), ``--samples-per-device 0 --image-size 28`` the whole 60,000 at 28x28.
A size *completes* when all 3 rounds close with every device's update accepted within the round
deadline. While it runs, the RSS of the coordinator process and of every worker is sampled (psutil, every
0.5 s) for their peaks. Reported per size: wall time of each round next to the slowest device's predicted
round time (the planner's estimate), and memory per device. The ladder stops at the first size that does
not complete; ``max_devices`` is the largest that did.

    python -m benchmarks.emulation --scale --json               the ladder (--sizes, default 300,1000,2000)
    python -m benchmarks.emulation --scale --devices 300        one size
    python -m benchmarks.emulation --scale --devices 300 --samples-per-device 0 --image-size 28 --deadline-s 400
    python -m benchmarks.emulation --scale --devices 1000 --device-type cuda --json   (CUDA workers)
    python -m benchmarks.emulation --scale --peer flower --deadline-s 240 --json   (Flower beside it)
    python -m benchmarks.emulation --scale --scale-dataset digits --sizes 300,1000 --peer flower --json

Every size also reports the median round, the rounds within the deadline, the peak PSS and CPU-seconds of
the whole process tree (:mod:`benchmarks.process_tree`) and the compute floor (N x one device's round
of host compute / cores). ``--peer flower`` runs the fleet with FedAvg and Flower's simulation engine on the
same task (:mod:`benchmarks.flower_peer`), alternating A B B A (``--pairs``, default 2), reporting
``ratio_vs_flower_<N>`` (the pairs' median) and ``spread_vs_flower_<N>``. Both trees start with one thread
per process (:data:`PINNED_THREADS`) and evaluate each round's model on every core (fedfleet's ``every_core``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import yaml

from benchmarks import flower_peer, scale_task
from benchmarks.process_tree import TreeSampler
from benchmarks.scale_fleet import DIGITS, ROUNDS, ScaleData, scale_fleet
from device_agent.emulation.limits import thread_env
from device_agent.emulation.packing import batch_flags

_ROOT = Path(__file__).resolve().parents[1]
_MIB = 2**20


def _slowest_predicted_seconds(path: Path) -> float:
    from coordinator.config.fleet import load_fleet
    from coordinator.planning.planner import plan_fleet

    fleet, catalog = load_fleet(path)
    return max(plan.est_round_seconds or 0.0 for plan in plan_fleet(fleet, catalog))


def _sample(process: psutil.Process, peaks: dict[str, dict[int, int]]) -> None:
    """Record the RSS of the coordinator and of each worker (peak per pid)."""
    try:
        peaks["coordinator"][process.pid] = max(peaks["coordinator"].get(process.pid, 0), process.memory_info().rss)
        children = process.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for child in children:
        try:
            if "worker" in child.cmdline() or "run" in child.cmdline():
                rss = child.memory_info().rss
                peaks["workers"][child.pid] = max(peaks["workers"].get(child.pid, 0), rss)
        except psutil.NoSuchProcess:
            continue


def _stop_tree(emulate: subprocess.Popen, process: psutil.Process, grace_s: float = 60) -> None:
    """Stop a run past its time, and everything it started: a coordinator too loaded to stop within ``grace_s``
    (2,000 devices on 2 cores) is killed with its broker and workers, and the sizes measured before it are kept."""
    from coordinator.transport.broker.base import terminate

    if emulate.poll() is not None:
        return
    try:
        children = process.children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    terminate(emulate, grace_s)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def run_size(
    devices: int,
    timeout: float = 1200,
    data: ScaleData = DIGITS,
    device_type: str = "cpu",
    deadline_s: float | None = None,
    rounds: int = ROUNDS,
    strategy: str = "fedhm",
    batch: bool | None = None,
) -> dict:
    """One emulated fleet of ``devices``; what it took and whether every round completed. ``batch``: True / False
    ``coordinator emulate --batch`` / ``--no-batch``, None its default (batched on CUDA workers only)."""
    from coordinator.transport.broker.base import free_port

    fleet = scale_fleet(devices, free_port(), data, deadline_s, rounds, strategy)
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-scale-") as folder:
        path, run_dir = Path(folder) / "fleet.yaml", Path(folder) / "run"
        path.write_text(yaml.safe_dump(fleet, sort_keys=False))
        predicted = _slowest_predicted_seconds(path)
        command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(path), "--run-dir", str(run_dir)]
        command += ["--device-type", device_type, *batch_flags(batch)]
        log = Path(folder) / "emulate.log"
        start = time.monotonic()
        with log.open("wb") as out:
            env = {**os.environ, **PINNED_THREADS}
            emulate = subprocess.Popen(
                [*command, "--no-live"], stdout=out, stderr=subprocess.STDOUT, cwd=_ROOT, env=env
            )
            process = psutil.Process(emulate.pid)
            peaks: dict[str, dict[int, int]] = {"coordinator": {}, "workers": {}}
            tree = TreeSampler(emulate.pid)
            try:
                while emulate.poll() is None and time.monotonic() - start <= timeout:
                    _sample(process, peaks)
                    tree.sample()
                    time.sleep(0.5)
            finally:
                _stop_tree(emulate, process)
        wall = time.monotonic() - start
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        tail = log.read_text(errors="replace")[-1500:]
        steps = _batched_steps(run_dir)
    accepted = [sum(d["status"] == "accepted" for d in r["devices"].values()) for r in records]
    deadline = float(fleet["round_deadline_s"])
    completed = (
        emulate.returncode == 0
        and len(records) == rounds
        and all(n == devices for n in accepted)
        and all(r["seconds"] <= deadline for r in records)
    )
    workers_rss = sum(peaks["workers"].values())
    result = {
        "devices": devices,
        "dataset": data.name,
        "image_size": fleet["model"].get("image_size", 8),
        "strategy": strategy,
        "device_type": device_type,
        "batch": batch,
        "worker_steps": steps,
        "train_images_per_device": data.images_per_device(devices),
        "completed": completed,
        "exit_code": emulate.returncode,
        "rounds_closed": len(records),
        "accepted_per_round": accepted,
        "round_seconds": [round(r["seconds"], 1) for r in records],
        "median_round_seconds": round(statistics.median(r["seconds"] for r in records), 2) if records else None,
        "rounds_within_deadline": sum(r["seconds"] <= deadline for r in records),
        "round_phases": [{k: round(v, 1) for k, v in r.get("phases", {}).items()} for r in records],
        "deadline_seconds": deadline,
        "slowest_predicted_round_seconds": round(predicted, 2),
        "wall_seconds": round(wall, 1),
        "accuracy": [round(r["accuracy"], 4) for r in records],
        "agent_processes": len(peaks["workers"]),
        "coordinator_peak_rss_mib": round(max(peaks["coordinator"].values(), default=0) / _MIB, 1),
        "coordinator_rss_per_device_mib": round(max(peaks["coordinator"].values(), default=0) / _MIB / devices, 2),
        "workers_peak_rss_mib": round(workers_rss / _MIB, 1),
        "workers_rss_per_device_mib": round(workers_rss / _MIB / devices, 2),
        **tree.summary(),
    }
    if not completed:
        result["log_tail"] = tail
    return result


_STEPS = re.compile(r"worker: (\d+) training steps ran batched, (\d+) one by one")


def _batched_steps(run_dir: Path) -> dict[str, int] | None:
    """The training steps the workers ran batched and one by one, as each logged when it stopped (None: none did)."""
    counts = [
        m.groups()
        for log in sorted((run_dir / "agents" / "workers").glob("*.log"))
        for m in _STEPS.finditer(log.read_text(errors="replace"))
    ]
    if not counts:
        return None
    return {"batched": sum(int(b) for b, _ in counts), "one_by_one": sum(int(o) for _, o in counts)}


PINNED_THREADS = thread_env(1)
"""The thread variables both engines' trees start with: one thread per process (an emulated device trains on one,
a Ray actor holds one core); the round close's evaluation then takes every core on both sides."""
PAIRS = 2
"""``--peer flower``: fedfleet/Flower pairs per size, run A B B A (each pair in the other order than the last)."""


def abba(pairs: int) -> list[tuple[str, str]]:
    """Each pair's order: a shared host's load drifts, and alternating gives both engines its early and late part."""
    return [("fedfleet", "flower") if index % 2 == 0 else ("flower", "fedfleet") for index in range(pairs)]


def _brief(run: dict) -> dict:
    keys = ("completed", "round_seconds", "median_round_seconds", "wall_seconds", "tree_cpu_seconds", "accuracy")
    return {key: run.get(key) for key in keys}


def _side_by_side(
    devices: int, pairs: int, fedfleet: Callable[[], dict], flower: Callable[[], dict]
) -> tuple[dict, dict]:
    """``pairs`` pairs of runs in ABBA order: fedfleet's first run (its ``flower``: Flower's first), every run's
    brief under ``pairs``, and the ratio's median and spread over the pairs (each pair's fedfleet / Flower median
    round)."""
    runners = {"fedfleet": fedfleet, "flower": flower}
    done: dict[str, list[dict]] = {"fedfleet": [], "flower": []}
    briefs, ratios = [], []
    for order in abba(pairs):
        pair = {engine: runners[engine]() for engine in order}
        for engine, run in pair.items():
            done[engine].append(run)
        ours, theirs = pair["fedfleet"]["median_round_seconds"], pair["flower"]["median_round_seconds"]
        ratio = round(ours / theirs, 3) if ours and theirs else None
        ratios.append(ratio)
        briefs.append({"order": list(order), "ratio": ratio, **{e: _brief(r) for e, r in pair.items()}})
    run = done["fedfleet"][0] | {"flower": done["flower"][0], "pairs": briefs}
    run["completed"] = all(r["completed"] for r in done["fedfleet"])
    run["flower"]["completed"] = all(r["completed"] for r in done["flower"])
    measured = [r for r in ratios if r is not None]
    summary = {
        f"ratio_vs_flower_{devices}": round(statistics.median(measured), 3) if len(measured) == len(ratios) else None,
        f"spread_vs_flower_{devices}": [min(measured), max(measured)] if measured else None,
    }
    return run, summary


def scale(
    sizes: list[int],
    data: ScaleData = DIGITS,
    device_type: str = "cpu",
    deadline_s: float | None = None,
    rounds: int = ROUNDS,
    peer: str | None = None,
    pairs: int = PAIRS,
    batch: bool | None = None,
) -> dict:
    """Sizes in increasing order until one does not complete (with a ``peer``, every size); ``max_devices``:
    the largest that did.

    Each size reports its compute floor (:func:`benchmarks.scale_task.compute_floor`). With ``peer="flower"``
    the fleet runs FedAvg and each size runs ``pairs`` times on each engine, alternating A B B A
    (:func:`abba`; Flower's side is :mod:`benchmarks.flower_peer`): ``run["flower"]`` is Flower's first run,
    ``run["pairs"]`` every run's times; ``ratio_vs_flower_<N>`` is the median over the pairs of fedfleet's
    median round over Flower's, ``spread_vs_flower_<N>`` the pairs' lowest and highest ratio.
    """
    strategy = "fedavg" if peer == "flower" else "fedhm"
    runs, ratios = [], {}
    for devices in sorted(sizes):
        options = {"data": data, "device_type": device_type, "deadline_s": deadline_s, "rounds": rounds, "batch": batch}
        if peer == "flower":
            run, summary = _side_by_side(
                devices,
                pairs,
                functools.partial(run_size, devices, strategy=strategy, **options),
                functools.partial(flower_peer.run_size, devices, data, rounds, deadline_s),
            )
            ratios |= summary
        else:
            run = run_size(devices, strategy=strategy, **options)
        run |= scale_task.compute_floor(scale_task.ScaleTask.build(devices, data, rounds, deadline_s))
        runs.append(run)
        if not run["completed"] and peer is None:
            break  # a ladder stops at its first failure; side by side, every size is compared
    done = [r["devices"] for r in runs if r["completed"]]
    return {"max_devices": max(done, default=0), "rounds": rounds, "strategy": strategy, **ratios, "runs": runs}


def describe(result: dict) -> list[str]:
    done = f"{result['rounds']} {result['strategy']} rounds"
    lines = [f"largest fleet completing {done}: {result['max_devices']} devices"]
    for run in result["runs"]:
        lines.append(
            f"{run['devices']} devices on {run['device_type']} "
            f"(steps {'batched: ' + str(run['worker_steps']) if run['worker_steps'] else 'one by one'}) "
            f"({run['train_images_per_device']} {run['dataset']} images each, {run['image_size']} px): "
            f"{'completed' if run['completed'] else 'FAILED'}; accuracy per round {run['accuracy']}; rounds "
            f"{run['round_seconds']} s (slowest device predicted {run['slowest_predicted_round_seconds']} s, "
            f"deadline {run['deadline_seconds']:g} s, compute floor {run['compute_floor_seconds']} s); "
            f"updates per round {run['accepted_per_round']}; coordinator peak {run['coordinator_peak_rss_mib']} MiB "
            f"({run['coordinator_rss_per_device_mib']} MiB/device); {run['agent_processes']} agent processes "
            f"{run['workers_peak_rss_mib']} MiB ({run['workers_rss_per_device_mib']} MiB/device); process tree "
            f"peak {run['tree_peak_pss_mib']} MiB, {run['tree_cpu_seconds']} CPU-s"
        )
        if "flower" in run:
            flower, ratio = run["flower"], result.get(f"ratio_vs_flower_{run['devices']}")
            lines.append(
                f"  Flower {flower['flwr']} (Ray {flower['ray']}, {flower['actors']} actors), same task: "
                f"{'completed' if flower['completed'] else 'FAILED'}; accuracy per round {flower['accuracy']}; "
                f"rounds {flower['round_seconds']} s; updates per round {flower['updates_per_round']}; process tree "
                f"peak {flower['tree_peak_pss_mib']} MiB, {flower['tree_cpu_seconds']} CPU-s; fedfleet / Flower "
                f"median round {ratio} (median of {len(run['pairs'])} ABBA pairs: "
                f"{[pair['ratio'] for pair in run['pairs']]})"
            )
    return lines
