"""The agent's start-up speed report with and without contention, old reading and steady one side by side.

Each simulated agent start times the matmul benchmark as the agent did before (one 0.2 s reading)
and as it does now (:func:`device_agent.agent.speed.steady_gflops`: the median of three readings, then
the upper median of the last starts kept in the state directory). Some starts run while
``--hogs`` busy processes compete for the CPU, as when several agents start at once on one host.
The figure of merit is the worst report of the run relative to the quiet speed (1.0 = never
fooled by contention).

    python -m benchmarks.probe_stability --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from device_agent.agent.probe import measure_matmul_gflops, resolve_device
from device_agent.agent.speed import REPEATS, steady_gflops

_WHO = {"hostname": "bench", "accelerator": "cpu", "accelerator_name": None, "torch": "bench"}
_SPIN = "while True: pass"
_HOGS_START_S = 0.5  # let the busy processes get past interpreter start-up before the readings


def run(starts: int, busy: set[int], hogs: int, seconds: float) -> dict[str, object]:
    dev = resolve_device("cpu")
    single: list[float] = []
    steady: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fedfleet-probe-bench-") as state:
        for start in range(starts):
            spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(hogs if start in busy else 0)]
            if spinners:
                time.sleep(_HOGS_START_S)
            try:
                samples = [measure_matmul_gflops(dev, seconds) for _ in range(REPEATS)]
            finally:
                for spinner in spinners:
                    spinner.kill()
                    spinner.wait()
            single.append(samples[0])
            steady.append(steady_gflops(samples, _WHO, Path(state)))
    quiet = statistics.median(g for i, g in enumerate(single) if i not in busy)
    return {
        "starts": starts,
        "busy_starts": sorted(busy),
        "hogs": hogs,
        "quiet_gflops": round(quiet, 2),
        "single_worst_ratio": round(min(single) / quiet, 3),
        "steady_worst_ratio": round(min(steady) / quiet, 3),
        "single_gflops": [round(g, 2) for g in single],
        "steady_gflops": [round(g, 2) for g in steady],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probe_stability",
        description="Worst start-up speed report under CPU contention: one reading vs the steady report, same run.",
    )
    parser.add_argument("--starts", type=int, default=6, help="agent starts simulated (default: %(default)s)")
    parser.add_argument("--busy", default="1,4", help="0-based starts run under contention (default: %(default)s)")
    parser.add_argument(
        "--hogs", type=int, default=os.cpu_count() or 2, help="busy processes during a busy start (default: CPU count)"
    )
    parser.add_argument("--seconds", type=float, default=0.2, help="one reading's budget (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    args = parser.parse_args(argv)
    busy = {int(i) for i in args.busy.split(",") if i.strip()}
    if not busy or max(busy) >= args.starts or len(busy) == args.starts:
        parser.error("--busy must name some, not all, of the starts 0..--starts-1")
    result = run(args.starts, busy, args.hogs, args.seconds)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
