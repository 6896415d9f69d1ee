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
of host compute / cores). ``--peer flower`` runs the fleet with FedAvg and then Flower's simulation
engine on the same task (:mod:`benchmarks.flower_peer`), reporting ``ratio_vs_flower_<N>``.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

from benchmarks.process_tree import TreeSampler

_ROOT = Path(__file__).resolve().parents[1]
_DEMO = _ROOT / "examples" / "demo.yaml"
ROUNDS = 3
_MIB = 2**20


DATASETS = ("digits", "fashion_mnist")
TRAIN_IMAGES = {"digits": 1437, "fashion_mnist": 60_000}


@dataclass(frozen=True)
class ScaleData:
    """Where the scale fleet's shards come from: a data set, at most ``samples`` training images per device
    (fleet.yaml's ``samples_per_device``; None: the set split evenly) and the images' side (None: the set's own).

    Why a cap and a smaller side: Fashion-MNIST's 60,000 at 28x28 split over 1,000 devices is 0.69 s of host
    compute per device-round on one thread, a 343 s compute floor on 2 cores, so no engine rounds it within a
    minute. ``recipe`` gives each set its scale default: Fashion-MNIST at 14x14, 8 images a device (a 38 s floor at
    1,000 devices), which keeps the accuracy after the rounds about learning on real images.
    """

    name: str = "digits"
    samples: int | None = None
    image_size: int | None = None

    @classmethod
    def recipe(cls, name: str, samples: int | None = None, image_size: int | None = None) -> ScaleData:
        """``name``'s scale default, ``samples`` (0: the set split evenly) and ``image_size`` replacing its values."""
        default = cls(name, 8, 14) if name == "fashion_mnist" else cls(name)
        return cls(
            name,
            default.samples if samples is None else samples or None,
            image_size or default.image_size,
        )

    def images_per_device(self, devices: int) -> int:
        share = TRAIN_IMAGES[self.name] // devices
        return share if self.samples is None else min(share, self.samples)

    def args(self) -> list[str]:
        """The flags that give another process (Flower's side of ``--peer flower``) this data."""
        flags = ["--dataset", self.name, "--samples-per-device", str(self.samples or 0)]
        return flags if self.image_size is None else [*flags, "--image-size", str(self.image_size)]


DIGITS = ScaleData()


def scale_fleet(
    devices: int,
    port: int,
    data: ScaleData = DIGITS,
    deadline_s: float | None = None,
    rounds: int = ROUNDS,
    strategy: str = "fedhm",
) -> dict:
    """The demo fleet with ``devices`` devices (its classes in turn, its overrides), iid data, 3 rounds;
    ``deadline_s`` replaces the demo's round deadline (a host that cannot train 60,000 images in it).

    ``strategy="fedavg"`` (the task ``--peer flower`` compares on): every device trains the full model, so
    the demo's ratios and the Pis' ``max_ratio`` caps go; the classes keep their compute, memory and links.
    """
    fleet = yaml.safe_load(_DEMO.read_text())
    if deadline_s is not None:
        fleet["round_deadline_s"] = deadline_s
    if data.name != "digits":
        fleet["dataset"]["name"] = data.name
        fleet["model"] |= {"in_channels": 1, "image_size": 28}
    if data.image_size is not None:
        fleet["model"]["image_size"] = data.image_size
    if data.samples is not None:
        fleet["dataset"]["samples_per_device"] = data.samples
    classes = [fleet["devices"][i] for i in (0, 3, 6)]  # orin, pi5 (max 1/2), pi4 (max 1/4)
    fleet["broker"]["port"] = port
    fleet["rounds"] = rounds
    fleet["dataset"]["partition"] = "iid"  # dirichlet over hundreds of ~5-image shards leaves some empty
    if strategy != "fedhm":
        fleet["strategy"] = {"name": strategy}
        del fleet["ratios"]
        classes = [{k: v for k, v in device.items() if k != "overrides"} for device in classes]
    fleet["devices"] = []
    for index in range(devices):
        device = dict(classes[index % 3])
        device["id"] = f"{device['id'].split('-')[0]}-{index:04d}"
        fleet["devices"].append(device)
    return fleet


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
) -> dict:
    """One emulated fleet of ``devices``; what it took and whether every round completed."""
    from coordinator.transport.broker.base import free_port

    fleet = scale_fleet(devices, free_port(), data, deadline_s, rounds, strategy)
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-scale-") as folder:
        path, run_dir = Path(folder) / "fleet.yaml", Path(folder) / "run"
        path.write_text(yaml.safe_dump(fleet, sort_keys=False))
        predicted = _slowest_predicted_seconds(path)
        command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(path), "--run-dir", str(run_dir)]
        command += ["--device-type", device_type]
        log = Path(folder) / "emulate.log"
        start = time.monotonic()
        with log.open("wb") as out:
            emulate = subprocess.Popen([*command, "--no-live"], stdout=out, stderr=subprocess.STDOUT, cwd=_ROOT)
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


def scale(
    sizes: list[int],
    data: ScaleData = DIGITS,
    device_type: str = "cpu",
    deadline_s: float | None = None,
    rounds: int = ROUNDS,
    peer: str | None = None,
) -> dict:
    """Sizes in increasing order until one does not complete (with a ``peer``, every size); ``max_devices``:
    the largest that did.

    Each size reports its compute floor (:func:`benchmarks.scale_task.compute_floor`). With ``peer="flower"``
    the fleet runs FedAvg and each size is run again by Flower's simulation engine right after
    (:mod:`benchmarks.flower_peer`), under ``run["flower"]``; ``ratio_vs_flower_<N>`` is fedfleet's median
    round over Flower's.
    """
    from benchmarks.scale_task import ScaleTask, compute_floor

    strategy = "fedavg" if peer == "flower" else "fedhm"
    runs, ratios = [], {}
    for devices in sorted(sizes):
        run = run_size(
            devices, data=data, device_type=device_type, deadline_s=deadline_s, rounds=rounds, strategy=strategy
        )
        run |= compute_floor(ScaleTask.build(devices, data, rounds, deadline_s))
        if peer == "flower":
            from benchmarks import flower_peer

            run["flower"] = flower = flower_peer.run_size(devices, data, rounds, deadline_s)
            ours, theirs = run["median_round_seconds"], flower["median_round_seconds"]
            ratios[f"ratio_vs_flower_{devices}"] = round(ours / theirs, 3) if ours and theirs else None
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
                f"median round {ratio}"
            )
    return lines
