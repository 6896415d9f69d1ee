"""SecAgg+ over the round engine and the in-memory transport: what a secure round costs against a plain one.

``benchmarks.secagg`` runs this for 10 and 100 devices (``--link-devices``): ``simulate()`` with real agents over
:class:`~coordinator.transport.memory_link.MemoryLink`, one round of FedAvg and of FedHM (levels 1, 1/2, 1/4 in
turn), plain and under ``secure_aggregation`` (the graph's suggested threshold and degree, clip 0.5, 16 bits). The
task is kept tiny (the CNN on 8x8 digits, the 1,797 training images split IID) so that the protocol, not training,
is what differs. Per device: bytes both ways over the whole round (the key exchange, the masked upload and the
unmasking included; ``metrics.jsonl``'s ``bytes_up`` + ``bytes_down``); at the coordinator: the round's wall
seconds and the run's CPU seconds (the agents share the process, so CPU is the fleet's and the coordinator's
together; divided by the devices it is the most a device's protocol costs).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.screening import OFF
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.run.rundir import read_metrics
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.secagg.graph import suggested
from device_agent.training.optimizer import TrainConfig

MODEL = ModelSpec("cnn", 10, 1, 8)
FEDHM_LEVELS = (1.0, 0.5, 0.25)
CLIP, BITS = 0.5, 16


def clients(devices: int, strategy: str) -> list[SimClient]:
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", devices, seed=0)
    test = (data.test_x[:64], data.test_y[:64])
    return [
        SimClient(
            f"d{i:03d}",
            FEDHM_LEVELS[i % len(FEDHM_LEVELS)] if strategy == "fedhm" else 1.0,
            client_shard(data.train_x, data.train_y, spec, i),
            test,
        )
        for i in range(devices)
    ]


def one_round(devices: int, strategy: str, secure: bool) -> dict:
    """One round over the memory link: bytes per device, the round's wall seconds, the run's CPU seconds."""
    data = load_dataset("digits", 8, 1)
    threshold, neighbours = suggested(devices)
    settings = {"threshold": threshold, "neighbours": neighbours, "clip": CLIP, "bits": BITS}
    with tempfile.TemporaryDirectory(prefix="secagg-link-") as tmp:
        cpu, wall = time.process_time(), time.perf_counter()
        simulate(
            build_strategy(strategy, MODEL, {}, seed=0),
            clients(devices, strategy),
            1,
            TrainConfig(epochs=1, seed=0),
            (data.test_x[:64], data.test_y[:64]),
            data.train_x[:64],
            server_evaluation=False,
            limits=OFF,
            secure_aggregation=settings if secure else None,
            run_dir=Path(tmp) / "run",
        )
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        [metrics] = read_metrics(Path(tmp) / "run" / "metrics.jsonl")
    rows = metrics.devices.values()
    accepted = sum(row.status == "accepted" for row in rows)
    return {
        "bytes_per_device": round(statistics.fmean(row.bytes_up + row.bytes_down for row in rows)),
        "bytes_up_per_device": round(statistics.fmean(row.bytes_up for row in rows)),
        "payload_bytes_per_device": round(statistics.fmean(row.payload_bytes for row in rows)),
        "round_seconds": round(metrics.seconds, 2),
        "run_cpu_seconds": round(cpu, 2),
        "run_wall_seconds": round(wall, 2),
        "accepted": accepted,
        "threshold": threshold,
        "neighbours": neighbours,
        "secure": None if metrics.secure is None else metrics.secure.model_dump(),
    }


def warm_up() -> None:
    """One small plain round first: the process's one-time costs (imports, the device probe) land in no row."""
    one_round(3, "fedavg", False)


def measure_link(devices: int, strategy: str) -> dict:
    """The plain and the secure round side by side, with the differences per device and at the coordinator."""
    plain, secure = one_round(devices, strategy, False), one_round(devices, strategy, True)
    return {
        "devices": devices,
        "strategy": strategy,
        "plain": plain,
        "secure": secure,
        "extra_bytes_per_device": secure["bytes_per_device"] - plain["bytes_per_device"],
        "bytes_ratio": round(secure["bytes_per_device"] / plain["bytes_per_device"], 3),
        "extra_round_seconds": round(secure["round_seconds"] - plain["round_seconds"], 2),
        "extra_cpu_seconds_per_device": round((secure["run_cpu_seconds"] - plain["run_cpu_seconds"]) / devices, 4),
        "all_accepted": plain["accepted"] == secure["accepted"] == devices,
    }


__all__ = ["measure_link", "one_round", "warm_up"]
