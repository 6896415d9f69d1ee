"""The cost model against this machine: predicted vs measured peak training memory and step time.

Every configuration (model x gamma x batch size) trains a few steps in two fresh subprocesses, one
after the other. The memory one reports the peak resident memory of its training steps (Linux's
VmHWM, reset after the model is built so construction does not count) above what the process held
before the model existed; it runs with a fixed glibc mmap threshold, so that resident memory is the
memory in use. The time one reports the fastest step under glibc's default allocator, as the agent
trains (at least ``--steps`` steps and a second of CPU time, so a 50 ms step is timed 20 times). The
memory process's step time is reported beside (``fixed_mmap_step_seconds``): there every tensor over
64 KiB is a fresh mmap whose page faults took 30-56 % of a ResNet-18 step, a cost the agent does not
pay; it is what this benchmark timed until 2026-11-29.

The prediction uses this machine's probed profile and nothing fitted to the timed steps: the probe's
matmul GFLOPS, its convolution training efficiency, and its batch-norm bandwidth on a reused 16 MiB
buffer and on a fresh 64 MiB one (``device-agent probe`` measures the same). Two sets of
configurations: ``DEFAULT_CONFIGS`` (ResNet-18 at batch 8 and 32, the small CNN at 32 and 256, gamma 1 to
1/8), on which the model's form was chosen (sqrt tile scaling, the fresh-mapping bandwidth above
32 MiB), and ``HELD_OUT`` (other models and batch sizes: ResNet-9, the 28 px CNN, ResNet-18 at 16, the
CNN at 128), never looked at while choosing it; each set's worst error is reported. Linux only
(/proc/self/status, /proc/self/clear_refs).

Everything runs on one torch thread and is timed in process CPU time (the probe's benchmarks too), so
that other jobs on a shared machine show up less as slow steps (they still share caches and memory
bandwidth: report the load).

    python -m benchmarks.costmodel --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.machine import describe
from device_agent.agent.probe import (
    measure_matmul_gflops,
    measure_memory_bandwidth_gbs,
    measure_training_efficiency,
    probe_device,
)
from device_agent.common.profile import ComputeSpec
from device_agent.layers.hybrid import hybrid
from device_agent.models import model_card
from profiles.catalog import profile_from_report
from profiles.costmodel import hybrid_workload, predict_memory, predict_step_seconds
from profiles.schema import DeviceClass

DEFAULT_CONFIGS = {"resnet18": (8, 32), "cnn": (32, 256)}
GAMMAS = (1.0, 0.5, 0.25, 0.125)
# (model, gamma, batch): models and batch sizes the model's form was not chosen on.
HELD_OUT = (
    ("resnet9", 1.0, 16),
    ("resnet9", 0.25, 16),
    ("cnn28", 1.0, 64),
    ("cnn28", 0.25, 64),
    ("resnet18", 0.5, 16),
    ("cnn", 0.5, 128),
)
CNN_IMAGE_SIZE = 32
MIN_TIMED_CPU_S = 1.0
MAX_STEPS = 40
# A fixed mmap threshold makes glibc hand every freed tensor back at once, so resident memory is
# the memory in use; with the default (dynamic) threshold glibc keeps some freed memory cached,
# which the planner's memory_safety_factor has to cover. Steps are timed without it (see above).
_MEMORY_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
_TIME_ENV = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _train_steps(arch: str, gamma: float, x: Tensor, y: Tensor, steps: int, optimizer: str) -> list[float]:
    model = hybrid(arch, gamma, 10, x.shape[1])
    model.train()
    momentum = 0.9 if optimizer == "momentum" else 0.0
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-3)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
    )
    loss_fn = nn.CrossEntropyLoss()
    # Reset the peak-RSS mark: what building the model (dense init + SVD) needed is not training memory.
    Path("/proc/self/clear_refs").write_text("5")
    times: list[float] = []
    while len(times) < steps or (sum(times) < MIN_TIMED_CPU_S and len(times) < MAX_STEPS):
        t0 = time.process_time()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(time.process_time() - t0)
    return times


def _worker(arch: str, gamma: float, batch: int, steps: int, optimizer: str, threads: int) -> dict[str, float]:
    """One configuration in this (fresh) process: peak step memory in bytes and fastest step seconds.

    A warm-up step of a throwaway model at the same batch first pages in the kernels' code and starts the
    thread pool: that is the runtime context (counted separately by the cost model), not the step's memory.
    (A one-sample warm-up left the code of the batch's own kernel paths to the measured steps: 8.6 MB of
    library pages, file-backed RSS, in a 28 px CNN's "training memory", 0.65 MB in ResNet-9's.) What the
    measured steps still paged in from files is reported (``file_backed_bytes``; ~0 when the warm-up did its
    job). The fastest
    of the timed steps is reported because the machine is shared: contention only ever adds time.
    """
    torch.set_num_threads(threads)
    card = model_card(arch)
    size = CNN_IMAGE_SIZE if arch == "cnn" else card.image_size
    torch.manual_seed(0)
    x = torch.randn(batch, card.in_channels, size, size)
    y = torch.randint(0, 10, (batch,))
    _train_steps(arch, gamma, x, y, 1, optimizer)
    gc.collect()
    before, files = _status_kib("VmRSS"), _status_kib("RssFile")
    times = _train_steps(arch, gamma, x, y, steps, optimizer)
    peak = _status_kib("VmHWM")
    return {
        "peak_bytes": (peak - before) * 1024,
        "file_backed_bytes": (_status_kib("RssFile") - files) * 1024,
        "step_seconds": min(times[1:]),
    }


def _measure(arch: str, gamma: float, batch: int, steps: int, optimizer: str, threads: int) -> dict[str, float]:
    """Peak memory under the fixed mmap threshold, step time under the default allocator (two processes)."""
    memory = _run_worker(arch, gamma, batch, steps, optimizer, threads, _MEMORY_ENV)
    timed = _run_worker(arch, gamma, batch, steps, optimizer, threads, _TIME_ENV)
    return {
        "peak_bytes": memory["peak_bytes"],
        "file_backed_bytes": memory["file_backed_bytes"],
        "step_seconds": timed["step_seconds"],
        "fixed_mmap_step_seconds": memory["step_seconds"],
    }


def _run_worker(
    arch: str, gamma: float, batch: int, steps: int, optimizer: str, threads: int, env: dict[str, str]
) -> dict[str, float]:
    command = [
        sys.executable,
        "-m",
        "benchmarks.costmodel",
        "--worker",
        arch,
        str(gamma),
        str(batch),
        str(steps),
        optimizer,
        str(threads),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True, env=env)
    return json.loads(done.stdout)


def probed_profile(probe_seconds: float) -> DeviceClass:
    """This machine's profile as ``device-agent probe`` measures it, timed in CPU time on one thread."""
    cpu = torch.device("cpu")
    gflops = measure_matmul_gflops(cpu, probe_seconds, time.process_time)
    compute = ComputeSpec(
        fp32_gflops=gflops,
        memory_bandwidth_gbs=measure_memory_bandwidth_gbs(cpu, clock=time.process_time),
        fresh_memory_bandwidth_gbs=measure_memory_bandwidth_gbs(cpu, clock=time.process_time, fresh=True),
        training_efficiency=measure_training_efficiency(cpu, gflops, clock=time.process_time),
    )
    report = probe_device(benchmark_seconds=0.1, device="cpu").model_copy(update={"compute": compute})
    return profile_from_report(report)


def _errors(rows: list[dict], key: str) -> float | None:
    """The worst absolute error of ``rows`` (None for a set that was not run)."""
    return max((abs(r[key]) for r in rows), default=None)


def run(
    configs: dict[str, tuple[int, ...]],
    steps: int,
    optimizer: str,
    probe_seconds: float,
    threads: int,
    gammas: tuple[float, ...] = GAMMAS,
    held_out: tuple[tuple[str, float, int], ...] = HELD_OUT,
) -> dict:
    torch.set_num_threads(threads)
    profile = probed_profile(probe_seconds)
    chosen = [(arch, gamma, batch) for arch, batches in configs.items() for batch in batches for gamma in gammas]
    table = []
    for config_set, settings in (("default", chosen), ("held_out", held_out)):
        for arch, gamma, batch in settings:
            measured = _measure(arch, gamma, batch, steps, optimizer, threads)
            size = CNN_IMAGE_SIZE if arch == "cnn" else None
            work = hybrid_workload(arch, gamma, batch, optimizer, image_size=size)
            predicted_memory = predict_memory(work, "cpu", include_runtime=False).total
            predicted_seconds = predict_step_seconds(work, profile)
            table.append(
                {
                    "set": config_set,
                    "arch": arch,
                    "gamma": str(Fraction(gamma).limit_denominator(1000)),
                    "batch_size": batch,
                    **measured,
                    "predicted_peak_bytes": predicted_memory,
                    "memory_rel_error": predicted_memory / measured["peak_bytes"] - 1,
                    "predicted_step_seconds": predicted_seconds,
                    "time_ratio_rel_error": predicted_seconds / measured["step_seconds"] - 1,
                }
            )
    default = [r for r in table if r["set"] == "default"]
    held = [r for r in table if r["set"] == "held_out"]
    compute = profile.compute
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": threads,
            "matmul_gflops": compute.fp32_gflops,
            "memory_bandwidth_gbs": compute.memory_bandwidth_gbs,
            "fresh_memory_bandwidth_gbs": compute.fresh_memory_bandwidth_gbs,
            "training_efficiency": compute.training_efficiency,
            "load_average_1min": os.getloadavg()[0],
        },
        "optimizer": optimizer,
        "fitted_to_timed_steps": False,
        "configs": table,
        "memory_rel_error_max": _errors(table, "memory_rel_error"),
        "time_ratio_rel_error_max": _errors(table, "time_ratio_rel_error"),
        "default_time_ratio_rel_error_max": _errors(default, "time_ratio_rel_error"),
        "held_out_time_ratio_rel_error_max": _errors(held, "time_ratio_rel_error"),
        "default_memory_rel_error_max": _errors(default, "memory_rel_error"),
        "held_out_memory_rel_error_max": _errors(held, "memory_rel_error"),
        "load_average_1min_after": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default prints it too)")
    parser.add_argument(
        "--steps", type=int, default=4, help="least training steps per configuration (the first is warm-up)"
    )
    parser.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="momentum")
    parser.add_argument("--probe-seconds", type=float, default=1.0, help="matmul benchmark budget for the profile")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for probe and training (1 resists a shared machine best)"
    )
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        arch, gamma, batch, steps, optimizer, threads = args.worker
        print(json.dumps(_worker(arch, float(gamma), int(batch), int(steps), optimizer, int(threads))))
        return 0
    provenance = describe()
    result = run(DEFAULT_CONFIGS, args.steps, args.optimizer, args.probe_seconds, args.threads)
    print(json.dumps(result | {"provenance": provenance}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
