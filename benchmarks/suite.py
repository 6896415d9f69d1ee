"""Run every benchmark, keep what each printed with its command, machine and date, and regenerate
the README's table from that: the one command behind every performance figure in the README.

    python -m benchmarks.suite [--only transport,export] [--results benchmarks/results.json] [--readme README.md]
    python -m benchmarks.suite --record NAME out.json "the command that wrote out.json"

Each benchmark runs in its own process (its imports and threads do not leak into the next) with the
options below, which keep it to a few minutes on a 2-core machine; the README says what the
full-size runs are. ``--only`` re-runs some and keeps the others' entries from the results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import table
from benchmarks.machine import describe


@dataclass(frozen=True)
class Benchmark:
    """``python -m benchmarks.<module> --json <args>``; ``cuda_args`` are added when a GPU is present.

    ``module`` defaults to ``name``; one module may appear under several names (its modes).
    """

    name: str
    args: tuple[str, ...] = ()
    cuda_args: tuple[str, ...] = ()
    module: str | None = None
    timeout_s: float | None = None
    """For a benchmark that needs longer than the suite's ``--timeout``."""
    gpu_only: bool = False
    """Measured only where a GPU is present (skipped, and its recorded figures kept, elsewhere)."""

    def command(self, cuda: bool) -> list[str]:
        module = f"benchmarks.{self.module or self.name}"
        return ["python", "-m", module, "--json", *self.args, *(self.cuda_args if cuda else ())]


# Add a benchmark here and it is run, recorded and shown in the README's table.
SUITE: tuple[Benchmark, ...] = (
    Benchmark("refactorize", ("--repeats", "1")),
    Benchmark("transport", ("--size-mib", "16", "--repeats", "5", "--devices", "8", "--fan-in-mib", "4")),
    Benchmark("costmodel"),
    Benchmark("emulation", ("--demo-rounds", "1")),
    # Every strategy on real images, 3 seeds, its paper's metric: 162 cells of 40 s to 4 minutes each on one core
    # (cnn28, 2,000 images), about 2.5 hours with --jobs 2 on the 2-core dev machine; --jobs N on N cores.
    Benchmark(
        "compare",
        ("--dataset", "fashion_mnist", "--scenario", "all", "--seeds", "3", "--jobs", "2"),
        timeout_s=4 * 3600,
    ),
    # FedLoRA on a ViT pre-trained on Fashion-MNIST 0-4 (cached; 12 epochs, about 15 minutes on a core the
    # first time), fine-tuned on 5-9: 26 cells of about 1.5 minutes, about 25 minutes with --jobs 2.
    Benchmark("fedlora", ("--scenario", "fedlora", "--seeds", "3", "--jobs", "2"), module="compare", timeout_s=7200),
    Benchmark("export", ("--repeats", "10")),
    # 300 packed agents on Fashion-MNIST shards (200 images each): about 18 minutes on the 2-core dev machine.
    Benchmark(
        "emulation_scale",
        ("--scale", "--devices", "300", "--samples-per-device", "0", "--image-size", "28", "--deadline-s", "400"),
        module="emulation",
        timeout_s=3600,
    ),
    # fedfleet's emulation and Flower's simulation (Ray) side by side at 300 and 1,000 devices, FedAvg on digits:
    # about 11 minutes on the 2-core dev machine. Needs the optional extra: pip install 'fedfleet[flower]'.
    Benchmark(
        "emulation_flower",
        ("--scale", "--scale-dataset", "digits", "--sizes", "300,1000", "--peer", "flower"),
        module="emulation",
    ),
    # The same side by side on Fashion-MNIST (8 images a device at 14x14) at 300 and 1,000 devices, with a 240 s
    # round deadline: about 20 minutes. (2,000 devices: docs/emulation.md, "Fashion-MNIST at scale".)
    Benchmark(
        "emulation_flower_fashion",
        ("--scale", "--sizes", "300,1000", "--peer", "flower", "--deadline-s", "240"),
        module="emulation",
        timeout_s=3 * 3600,
    ),
    # 1,000 devices in CUDA workers (4 of 250 devices), Fashion-MNIST as above: about 2 minutes on an H200 host.
    Benchmark(
        "emulation_scale_cuda",
        ("--scale", "--sizes", "1000", "--deadline-s", "240"),
        cuda_args=("--device-type", "cuda"),
        module="emulation",
        gpu_only=True,
    ),
    Benchmark("process_peak", ("--memory",), module="emulation"),
    Benchmark("faults", ("--repeats", "1")),  # runs benchmarks.bad_inputs too (key bad_inputs)
    Benchmark("json_bounds"),
    Benchmark("probe_stability"),
    Benchmark("poisoning"),  # 54 short simulations: about 8 minutes on 2 idle cores, 20 on a busy one
    # DP-FedAvg on Fashion-MNIST, 100 devices, 3 seeds, FedAvg and FedHM at epsilon inf/8/2, fixed and adaptive clip:
    # 30 simulations; 5 rounds take about 30 minutes on 2 shared cores (the module's default is 10 rounds).
    Benchmark("privacy", ("--rounds", "5", "--jobs", "2"), timeout_s=2 * 3600),
    Benchmark("soak", ("--minutes", "20"), timeout_s=3600),  # churn, broker and coordinator crashes for 20 minutes
    Benchmark("secagg"),  # SecAgg+ at 10/100/300 devices in process, rounds of 10/100 over the memory link: ~5 minutes
    Benchmark("secagg_accuracy"),  # FedAvg and FedHM on Fashion-MNIST, 10 devices, 5 rounds, 3 seeds: ~15 minutes
    Benchmark("async", ("--jobs", "2"), timeout_s=3600),  # 30 devices x 3 modes x 3 seeds on the fleet clock
)


class BenchmarkFailed(RuntimeError):
    """A benchmark that exited non-zero or printed no JSON object."""


def parse_output(name: str, stdout: str) -> dict[str, Any]:
    """The benchmark's JSON object: all of stdout (some indent it), else its last line (after progress lines)."""
    text = stdout.strip()
    for candidate in (text, text.splitlines()[-1] if text else ""):
        try:
            result = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict):
            return result
    raise BenchmarkFailed(f"{name} printed no JSON object (its output ends with: {text[-200:]!r})")


def run_one(benchmark: Benchmark, cuda: bool, timeout_s: float) -> dict[str, Any]:
    """Run one benchmark in a fresh interpreter and take the JSON object it prints."""
    shown = benchmark.command(cuda)
    print(f"$ {shlex.join(shown)}", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, *shown[1:]], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise BenchmarkFailed(f"{benchmark.name} ran past {timeout_s:.0f} s") from None
    seconds = time.perf_counter() - start
    if done.returncode != 0 or not done.stdout.strip():
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise BenchmarkFailed(f"{benchmark.name} exited with {done.returncode}:\n{tail}")
    result = parse_output(benchmark.name, done.stdout)
    print(f"  {benchmark.name}: {seconds:.0f} s", flush=True)
    return {"command": shlex.join(shown), "result": result, "seconds": round(seconds, 1)}


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"benchmarks": {}}
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BenchmarkFailed(f"{path} is not valid JSON ({exc}); move it away to start afresh") from None
    if not isinstance(results.get("benchmarks"), dict):
        raise BenchmarkFailed(f"{path} has no 'benchmarks' object; move it away to start afresh")
    return results


def run_suite(names: list[str], results_path: Path, readme: Path | None, timeout_s: float) -> dict[str, Any]:
    """Run ``names`` (in suite order), merge into ``results_path``, regenerate ``readme``'s table."""
    results = load(results_path)
    machine = describe()
    cuda = machine["gpu"] is not None
    failures = []
    for benchmark in SUITE:
        if benchmark.name not in names:
            continue
        if benchmark.gpu_only and not cuda:
            print(f"  {benchmark.name}: skipped, it needs a GPU (its recorded figures are kept)", flush=True)
            continue
        try:
            entry = run_one(benchmark, cuda, max(timeout_s, benchmark.timeout_s or 0))
        except BenchmarkFailed as exc:
            failures.append(str(exc))
            print(f"  FAILED: {exc}", file=sys.stderr, flush=True)
            continue
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        device = "cuda" if cuda and benchmark.cuda_args else "cpu"
        results["benchmarks"][benchmark.name] = entry | {"machine": machine, "device": device, "date": date}
        # Written after each benchmark: a failure later keeps what was measured so far.
        results_path.write_text(json.dumps(results, indent=1) + "\n")
    if readme is not None and results["benchmarks"]:
        readme.write_text(table.replace_table(readme.read_text(), table.render(results)))
    if failures:
        raise BenchmarkFailed(f"{len(failures)} benchmark(s) failed:\n" + "\n".join(failures))
    return results


def record(
    name: str, output: Path, command: str, results_path: Path, readme: Path | None, note: str | None = None
) -> dict[str, Any]:
    """Keep a run made outside the suite (a long resumed ``compare``, say) as entry ``name``: its JSON
    ``output`` must carry the ``provenance`` it ran under (commit, dirty flag, CPU, torch), which becomes
    the entry's machine; the date is when it is recorded. A result without provenance is refused: its
    figures could not be told from another commit's or another CPU's."""
    try:
        result = json.loads(output.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchmarkFailed(f"--record {name}: cannot read {output} as JSON ({exc})") from None
    provenance = result.pop("provenance", None) if isinstance(result, dict) else None
    if not isinstance(provenance, dict) or "commit" not in provenance:
        raise BenchmarkFailed(
            f"--record {name}: {output} carries no provenance (commit, CPU, torch); record the JSON of a "
            "benchmark that writes it (benchmarks.compare --json does)"
        )
    results = load(results_path)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    device = "cuda" if provenance.get("gpu") else "cpu"
    results["benchmarks"][name] = {"command": command, "result": result, "machine": provenance}
    results["benchmarks"][name] |= {"device": device, "date": date} | ({"note": note} if note else {})
    results_path.write_text(json.dumps(results, indent=1) + "\n")
    if readme is not None:
        readme.write_text(table.replace_table(readme.read_text(), table.render(results)))
    return results


def main(argv: list[str] | None = None) -> int:
    known = [b.name for b in SUITE]
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.suite",
        description="Run every benchmark, write results.json (figures, command, machine, date) and the README table.",
    )
    parser.add_argument("--only", help=f"comma-separated subset of: {', '.join(known)} (default: all)")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results.json"), help="default: %(default)s")
    parser.add_argument("--readme", type=Path, default=Path("README.md"), help="table target (default: %(default)s)")
    parser.add_argument("--no-readme", action="store_true", help="only write the results file")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per benchmark (default: %(default)s)")
    parser.add_argument(
        "--record",
        nargs=3,
        metavar=("NAME", "JSON_FILE", "COMMAND"),
        help="instead of running: keep JSON_FILE (a run's --json output, with its provenance) as entry NAME, "
        "run by COMMAND",
    )
    parser.add_argument("--note", help="with --record: what the entry is not (a partial run, reduced sizes)")
    args = parser.parse_args(argv)
    readme = None if args.no_readme else args.readme
    if args.record:
        name, output, command = args.record
        try:
            record(name, Path(output), command, args.results, readme, args.note)
        except (BenchmarkFailed, table.TableError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else known
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(known)}")
    try:
        run_suite(names, args.results, readme, args.timeout)
    except (BenchmarkFailed, table.TableError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
