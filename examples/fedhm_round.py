"""FedHM in one process, on scikit-learn's digits: the math of a round without the fleet.

Four clients hold a Dirichlet share of the digits and train hybrid CNNs at rank ratios 1, 1/2,
1/4 and 1/8 (Frobenius decay on factors). Each round the server rebuilds full-rank weights from
their factors, aggregates them with the paper's weighting, and re-factorizes for every level
from one decomposition per layer. Real fleets run the same functions over MQTT.

    python examples/fedhm_round.py [--rounds 10]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from coordinator.algorithms.aggregation import StreamingAggregator, aggregation_weights
from coordinator.algorithms.lowrank import factorize
from device_agent.layers.hybrid import factorization_plan, hybrid
from device_agent.layers.regularizers import apply_frobenius_decay_, parameter_groups

RATIOS = (1.0, 0.5, 0.25, 0.125)


Split = tuple[torch.Tensor, torch.Tensor]


def digits(seed: int, clients: int, alpha: float) -> tuple[list[Split], Split, Split]:
    """Client shards (Dirichlet over labels), a small server calibration split, and a test split."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y)
    order = np.random.default_rng(seed).permutation(len(y))
    test, server, train = order[:360], order[360:560], order[560:]
    rng = np.random.default_rng(seed + 1)
    shards: list[list[int]] = [[] for _ in range(clients)]
    for label in range(10):
        members = train[y[train].numpy() == label]
        cuts = (np.cumsum(rng.dirichlet([alpha] * clients)) * len(members)).astype(int)[:-1]
        for shard, part in zip(shards, np.split(members, cuts), strict=True):
            shard.extend(part.tolist())
    return [(x[s], y[s]) for s in shards], (x[server], y[server]), (x[test], y[test])


def train_locally(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> None:
    optimizer = torch.optim.SGD(parameter_groups(model, 5e-4), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(32):
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            apply_frobenius_decay_(model, 5e-4)
            optimizer.step()


@torch.no_grad()
def calibrate_batchnorm(model: torch.nn.Module, x: torch.Tensor) -> None:
    """Static BN (HeteroFL): running statistics recomputed from server data, never averaged."""
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None
    model.train()
    model(x)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2, help="local epochs per round")
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration of the label split")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    shards, (x_server, _), (x_test, y_test) = digits(args.seed, len(RATIOS), args.alpha)
    plan = factorization_plan("cnn")
    global_state = hybrid("cnn", 1.0).state_dict()
    alphas = aggregation_weights("paper", RATIOS)
    print(
        "clients: "
        + ", ".join(f"gamma={g:g} n={len(s[1])} alpha={a:.3f}" for g, s, a in zip(RATIOS, shards, alphas, strict=True))
    )
    for round_index in range(1, args.rounds + 1):
        levels = factorize(global_state, plan, RATIOS)
        aggregator = StreamingAggregator(global_state, plan, "paper")
        local = []
        for client, (gamma, (x, y)) in enumerate(zip(RATIOS, shards, strict=True)):
            model = hybrid("cnn", gamma)
            model.load_state_dict(levels[gamma])
            train_locally(model, x, y, args.epochs, seed=round_index * 100 + client)
            local.append(accuracy(model, x_test, y_test))
            upload = {k: v for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
            aggregator.add(upload, gamma, len(y))
        global_state = aggregator.result()
        evaluated = hybrid("cnn", 1.0)
        evaluated.load_state_dict(global_state)
        calibrate_batchnorm(evaluated, x_server)
        global_state = evaluated.state_dict()
        print(
            f"round {round_index:2d}: global test accuracy {accuracy(evaluated, x_test, y_test):.3f}; "
            "local models on all classes " + " ".join(f"{a:.2f}" for a in local)
        )


if __name__ == "__main__":
    main()
