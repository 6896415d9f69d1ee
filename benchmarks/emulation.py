"""How closely an emulated agent is held to its profile: slowdown, link rate, usable memory.

- slowdown: blocks of the same training steps run plainly and under ``Throttle(factor)``, alternating
  so both see the same machine load; reports throttled wall time over the throttle's own measured
  compute (the control itself) and over the plain blocks (end to end, noisy on shared cores).
- link: 256 KiB chunks through a ``TokenBucket``; reports achieved / configured bytes per second.
- memory: in a fresh process, ``cap_cpu_memory(budget)`` then the largest single tensor that can
  still be allocated; reports it as a fraction of the budget (what address-space accounting costs).
- device time: ``coordinator emulate`` on the demo fleet (one device per class by default, side by
  side over a real mosquitto) for ``--demo-rounds`` rounds; per class, the emulated training seconds
  the agents report over the cost model's prediction (steps x predicted step time at the level
  trained). ``host_bound`` marks a class whose host compute alone exceeded the prediction: this
  host cannot run that device's step as fast as the device, so it is emulated slower.

    python -m benchmarks.emulation --json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import yaml

from device_agent.agent.config import load_config
from device_agent.data.datasets import FASHION_MNIST, DatasetError, check_source, load_dataset
from device_agent.data.partition import partition
from device_agent.emulation.limits import Throttle, step_seconds_at
from device_agent.emulation.packing import add_batch_arguments
from device_agent.emulation.shaping import TokenBucket

_ROOT = Path(__file__).resolve().parents[1]
_DEMO = _ROOT / "examples" / "demo.yaml"

_CHUNK = 256 * 1024


def slowdown(factor: float, steps: int, blocks: int = 5) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch, labels = torch.randn(128, 512), torch.randint(0, 10, (128,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(batch), labels).backward()
        optimizer.step()

    for _ in range(3):
        step()
    throttle = Throttle(factor)
    plain, throttled = [], []
    for _ in range(blocks):  # alternating blocks, so both see the same machine load
        start = time.perf_counter()
        for _ in range(steps):
            step()
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(steps):
            with throttle.step():
                step()
        throttle.flush()
        throttled.append(time.perf_counter() - start)
    return {
        "factor": factor,
        "measured_vs_own_compute": round(sum(throttled) / throttle.busy_seconds, 3),
        "measured_vs_plain": round(statistics.median(throttled) / statistics.median(plain), 3),
        "plain_step_ms": round(statistics.median(plain) / steps * 1e3, 2),
    }


def link(rate: float, megabytes: float) -> dict:
    bucket = TokenBucket(rate, burst_bytes=_CHUNK)
    bucket.consume(_CHUNK)
    chunks = max(1, int(megabytes * 1e6 / _CHUNK))
    start = time.monotonic()
    for _ in range(chunks):
        bucket.consume(_CHUNK)
    elapsed = time.monotonic() - start
    return {"rate_bytes_per_s": rate, "measured_vs_configured": round(chunks * _CHUNK / elapsed / rate, 4)}


_PROBE = """
import torch
from device_agent.emulation.limits import cap_cpu_memory
budget = {budget}
cap_cpu_memory(budget)
low, high = 0, 2 * budget // 2**20
while low < high:
    mid = (low + high + 1) // 2
    try:
        torch.empty(mid * 2**20, dtype=torch.uint8)
        low = mid
    except RuntimeError:
        high = mid - 1
print(low * 2**20)
"""


def usable_memory(budget: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PROBE.format(budget=budget))],
        capture_output=True,
        text=True,
        check=True,
    )
    largest = int(done.stdout.strip())
    return {"budget_bytes": budget, "largest_tensor_vs_budget": round(largest / budget, 4)}


def _predicted_train_seconds(agent_yaml: Path, level: float, fleet: dict) -> float:
    """Steps of one round on the agent's own shard x the step time it is held to (what the planner predicts)."""
    config = load_config(agent_yaml)
    assert config.emulation is not None and config.emulation.step_seconds is not None
    split = config.data.partition_spec()
    assert split is not None and config.data.index is not None
    samples = len(partition(load_dataset(config.data.source).train_y, split)[config.data.index])
    training = fleet["training"]
    steps = training["local_epochs"] * math.ceil(samples / training["batch_size"])
    return steps * step_seconds_at(config.emulation.step_seconds, level)


def device_time(rounds: int, every: int = 3, timeout: float = 600) -> list[dict]:
    """The demo's device classes side by side: emulated vs predicted training seconds, per class."""
    from coordinator.transport.broker.base import free_port

    fleet = yaml.safe_load(_DEMO.read_text())
    fleet["transport"]["broker"]["port"] = free_port()
    fleet["rounds"] = rounds
    fleet["devices"] = fleet["devices"][::every]
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-emulation-") as folder:
        path, run_dir = Path(folder) / "fleet.yaml", Path(folder) / "run"
        path.write_text(yaml.safe_dump(fleet, sort_keys=False))
        command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(path), "--run-dir", str(run_dir)]
        done = subprocess.run([*command, "--no-live"], capture_output=True, text=True, timeout=timeout, cwd=_ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"coordinator emulate failed ({done.returncode}): {done.stderr[-2000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        classes: dict[str, dict[str, list[float]]] = {}
        for record in records:
            for name, device in record["devices"].items():
                if device["status"] != "accepted":
                    continue
                predicted = _predicted_train_seconds(run_dir / "agents" / name / "agent.yaml", device["ratio"], fleet)
                row = classes.setdefault(device["device_class"], {"emulated": [], "predicted": [], "host": []})
                row["emulated"].append(device["train_seconds"])
                row["predicted"].append(predicted)
                row["host"].append(device["host_seconds"])
    return [
        {
            "device_class": name,
            "rounds": len(row["emulated"]),
            "emulated_seconds": round(statistics.mean(row["emulated"]), 3),
            "predicted_seconds": round(statistics.mean(row["predicted"]), 3),
            "host_seconds": round(statistics.mean(row["host"]), 3),
            "emulated_vs_predicted": round(sum(row["emulated"]) / sum(row["predicted"]), 3),
            "host_bound": sum(row["host"]) > sum(row["predicted"]),
        }
        for name, row in sorted(classes.items())
    ]


def run(
    factors: list[float], steps: int, rates: list[float], megabytes: float, budgets: list[int], demo_rounds: int = 0
) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each emulated agent on a small host runs
    try:
        result = {
            "benchmark": "emulation",
            "torch_threads": torch.get_num_threads(),
            "slowdown": [slowdown(f, steps) for f in factors],
            "link": [link(r, megabytes) for r in rates],
            "memory": [usable_memory(b) for b in budgets],
        }
    finally:
        torch.set_num_threads(threads)
    result["device_time"] = device_time(demo_rounds) if demo_rounds > 0 else []
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.emulation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--factors", default="2,4,8", help="slowdown factors (default: 2,4,8)")
    parser.add_argument(
        "--steps", type=int, default=20, help="steps per timed block; 5 blocks per factor (default: 20)"
    )
    parser.add_argument("--rates", default="1e6,1e7", help="link rates in bytes/s (default: 1e6,1e7)")
    parser.add_argument("--megabytes", type=float, default=2.0, help="data sent per link rate (default: 2)")
    parser.add_argument("--budgets-mib", default="256,1024", help="memory budgets in MiB (default: 256,1024)")
    parser.add_argument(
        "--demo-rounds",
        type=int,
        default=3,
        help="rounds of the emulated demo (one device per class) for device time; 0 skips it (default: 3)",
    )
    parser.add_argument(
        "--scale", action="store_true", help="only the fleet-size ladder (benchmarks/emulation_scale.py): max_devices"
    )
    parser.add_argument("--sizes", default="300,1000,2000", help="--scale: fleet sizes (default: 300,1000,2000)")
    parser.add_argument("--devices", type=int, metavar="N", help="--scale: run this one fleet size")
    parser.add_argument(
        "--scale-dataset",
        choices=["digits", FASHION_MNIST],
        default=FASHION_MNIST,
        help="--scale: shards from Fashion-MNIST's 60,000 (default; apt-get install dataset-fashion-mnist) "
        "or digits' 1,437",
    )
    parser.add_argument(
        "--samples-per-device",
        type=int,
        metavar="N",
        help="--scale: training images per device, 0 for the set split evenly (default: 8 with fashion_mnist, so "
        "2 cores can round 1,000 devices in a minute; digits: split evenly)",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        metavar="PX",
        help="--scale: images resized to PX x PX (default: 14 with fashion_mnist; digits' own 8)",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        help="--scale: round deadline in seconds instead of the demo's 60 (a small host training Fashion-MNIST)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--scale: rounds per size (default: 3)")
    add_batch_arguments(
        parser,
        "--scale: workers batch their devices' steps where cheaper (coordinator emulate --batch; default on CUDA)",
        "--scale: workers train each device's steps one by one (coordinator emulate --no-batch; default on CPU)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=2,
        help="--scale --peer: fedfleet/Flower pairs per size, run A B B A to share a loaded host's drift (default: 2)",
    )
    parser.add_argument(
        "--peer",
        choices=["flower"],
        help="--scale: also run each size with Flower's simulation engine on the same FedAvg task "
        "(benchmarks/flower_peer.py; needs the optional extra: pip install 'fedfleet[flower]')",
    )
    parser.add_argument(
        "--device-type",
        default="cpu",
        help="--scale: where the emulated agents train: cpu (default), cuda, cuda:N",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="only predicted vs measured agent process peak (benchmarks/process_peak.py): process_peak",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.peer and not args.scale:
        parser.error("--peer runs beside the fleet-size ladder: add --scale")
    if args.memory:
        from benchmarks import process_peak

        peak = process_peak.process_peak()
        print(
            json.dumps({"benchmark": "emulation", "process_peak": peak})
            if args.json
            else "\n".join(process_peak.describe(peak))
        )
        return 0
    if args.scale:
        from benchmarks import emulation_scale
        from benchmarks.scale_fleet import TRAIN_IMAGES, ScaleData

        sizes = [args.devices] if args.devices else [int(x) for x in args.sizes.split(",")]
        data = ScaleData.recipe(args.scale_dataset, args.samples_per_device, args.image_size)
        images = TRAIN_IMAGES[args.scale_dataset]
        if max(sizes) > images:
            print(
                f"--scale-dataset {args.scale_dataset} has {images} training images: {max(sizes)} devices would leave "
                f"{max(sizes) - images} of them without data (their rounds fail); use --scale-dataset fashion_mnist",
                file=sys.stderr,
            )
            return 2
        try:
            check_source(args.scale_dataset)
        except DatasetError as error:
            print(f"--scale-dataset {args.scale_dataset}: {error}", file=sys.stderr)
            return 2
        if args.peer == "flower":
            from benchmarks.flower_peer import FlowerMissing, require_flower

            try:
                require_flower()
            except FlowerMissing as error:
                print(error, file=sys.stderr)
                return 2
        outcome = emulation_scale.scale(
            sizes, data, args.device_type, args.deadline_s, args.rounds, args.peer, args.pairs, args.batch
        )
        print(
            json.dumps({"benchmark": "emulation", **outcome})
            if args.json
            else "\n".join(emulation_scale.describe(outcome))
        )
        return 0
    result = run(
        [float(x) for x in args.factors.split(",")],
        args.steps,
        [float(x) for x in args.rates.split(",")],
        args.megabytes,
        [int(x) * 2**20 for x in args.budgets_mib.split(",")],
        args.demo_rounds,
    )
    if args.json:
        print(json.dumps(result))
        return 0
    for row in result["slowdown"]:
        print(
            f"slowdown x{row['factor']:g}: vs own compute {row['measured_vs_own_compute']}, "
            f"vs plain steps {row['measured_vs_plain']}"
        )
    for row in result["link"]:
        print(f"link {row['rate_bytes_per_s']:.0f} B/s: achieved / configured {row['measured_vs_configured']}")
    for row in result["memory"]:
        print(f"memory cap {row['budget_bytes'] >> 20} MiB: largest tensor / budget {row['largest_tensor_vs_budget']}")
    for row in result["device_time"]:
        print(
            f"device time {row['device_class']}: emulated {row['emulated_seconds']} s / predicted "
            f"{row['predicted_seconds']} s = {row['emulated_vs_predicted']} (host computed {row['host_seconds']} s"
            f"{', host-bound' if row['host_bound'] else ''})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
