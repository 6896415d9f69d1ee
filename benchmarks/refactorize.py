"""Per-round re-factorization: the reference scheme against fedfleet's, side by side in one run.

The reference (CGCL-codes/FedHM) runs one full SVD per layer per rank level. fedfleet runs one
decomposition per layer (a symmetric eigendecomposition of the smaller Gram matrix) and serves
every level by truncation. Both are timed alternately in the same process, medians compared;
fedfleet's factors are checked against the exact truncated SVD (computed in float64, untimed), also
on ill-conditioned matrices whose kept spectrum spans up to six decades (docs/factorization.md).

    python -m benchmarks.refactorize --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from coordinator.algorithms.lowrank import align, factorize
from device_agent.layers.factorized import matrices_to_factors, spectral_factors, weight_to_matrix
from device_agent.layers.hybrid import LayerSpec, factorization_plan, hybrid


def reference_factorize(
    state: Mapping[str, Tensor], plan: Mapping[str, LayerSpec], gammas: Sequence[float]
) -> dict[float, dict[str, Tensor]]:
    """The reference scheme: a fresh full SVD of every layer for every rank level."""
    out: dict[float, dict[str, Tensor]] = {}
    for gamma in gammas:
        level = dict(state)
        for name, spec in plan.items():
            u, s, vh = torch.linalg.svd(weight_to_matrix(level.pop(f"{name}.weight")), full_matrices=False)
            r = spec.rank(gamma)
            root = s[:r].sqrt()
            level[f"{name}.reduce"], level[f"{name}.expand"] = matrices_to_factors(
                u[:, :r] * root, root[:, None] * vh[:r], spec.shape
            )
        out[gamma] = level
    return out


def relative_errors(
    state: Mapping[str, Tensor], plan: Mapping[str, LayerSpec], levels: Mapping[float, Mapping[str, Tensor]]
) -> dict[tuple[str, float], float]:
    """||W - A B||_F / ||W||_F per (layer, level), in float64."""
    errors = {}
    for gamma, level in levels.items():
        rebuilt = align(level, plan)
        for name in plan:
            w = state[f"{name}.weight"].double()
            errors[(name, gamma)] = float((w - rebuilt[f"{name}.weight"].double()).norm() / w.norm())
    return errors


def optimal_errors(
    state: Mapping[str, Tensor], plan: Mapping[str, LayerSpec], gammas: Sequence[float]
) -> dict[tuple[str, float], float]:
    """Eckart-Young: the best rank-r relative error is the norm of the dropped singular values."""
    errors = {}
    for name, spec in plan.items():
        s = torch.linalg.svdvals(weight_to_matrix(state[f"{name}.weight"].double()))
        for gamma in gammas:
            errors[(name, gamma)] = float(s[spec.rank(gamma) :].norm() / s.norm())
    return errors


def ill_conditioned_gaps(rows: int = 768, cols: int = 384, spans: Sequence[int] = (1, 2, 3, 4, 6)) -> dict[str, float]:
    """Error above the optimum of float32 factors at half rank, for kept spectra spanning 10^d.

    The singular values fall evenly over 2d decades, so the kept half spans d of them.
    """
    generator = torch.Generator().manual_seed(0)
    k = min(rows, cols)
    left, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64, generator=generator))
    right, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64, generator=generator))
    gaps = {}
    for decades in spans:
        singular_values = torch.logspace(0, -2 * decades, k, dtype=torch.float64)
        exact = (left * singular_values) @ right.T
        a, b = spectral_factors(exact.float(), k // 2)
        error = float((exact - a.double() @ b.double()).norm() / exact.norm())
        gaps[f"1e{decades}"] = error - float(singular_values[k // 2 :].norm() / singular_values.norm())
    return gaps


def run(arch: str, gammas: Sequence[float], repeats: int, num_classes: int = 10) -> dict:
    torch.manual_seed(0)
    state = hybrid(arch, 1.0, num_classes).state_dict()
    plan = factorization_plan(arch, num_classes)
    reference_factorize(state, plan, gammas)
    factorize(state, plan, gammas)
    reference_times, fedfleet_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        reference = reference_factorize(state, plan, gammas)
        reference_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        ours = factorize(state, plan, gammas)
        fedfleet_times.append(time.perf_counter() - start)
    optimal = optimal_errors(state, plan, gammas)
    mine = relative_errors(state, plan, ours)
    theirs = relative_errors(state, plan, reference)
    reference_s = statistics.median(reference_times)
    fedfleet_s = statistics.median(fedfleet_times)
    return {
        "benchmark": "refactorize",
        "arch": arch,
        "rank_levels": list(gammas),
        "factorized_layers": len(plan),
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "reference_seconds": round(reference_s, 4),
        "fedfleet_seconds": round(fedfleet_s, 4),
        "speedup": round(reference_s / fedfleet_s, 2),
        "max_rel_error_gap": max(mine[key] - optimal[key] for key in optimal),
        "reference_max_rel_error_gap": max(theirs[key] - optimal[key] for key in optimal),
        "mean_rel_error": {str(g): statistics.mean(mine[(n, g)] for n in plan) for g in gammas},
        "ill_conditioned_error_gap_by_kept_span": ill_conditioned_gaps(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.refactorize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="resnet18", help="model (default: resnet18)")
    parser.add_argument("--levels", default="0.5,0.25,0.125", help="rank ratios (default: 0.5,0.25,0.125)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each scheme (default: 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run(args.arch, [float(x) for x in args.levels.split(",")], args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['arch']} levels {result['rank_levels']}: reference {result['reference_seconds']:.3f} s, "
            f"fedfleet {result['fedfleet_seconds']:.3f} s -> speedup {result['speedup']}x; "
            f"max relative-error gap to exact truncated SVD {result['max_rel_error_gap']:.2e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
