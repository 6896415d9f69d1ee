"""Client partitions for emulation and comparisons, reproducible from a handful of numbers.

Every scheme is a pure function of (labels, scheme, seed, number of clients), so an emulated
agent computes its own shard from (dataset, scheme, seed, client index, num clients) and gets
exactly what the coordinator's simulation would give it. Splitting the test labels with the
same arguments gives each client a test shard from its own distribution (same Dirichlet
proportions, same class group), which is what personalized accuracy is measured on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

Scheme = Literal["iid", "dirichlet", "domains"]
SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "domains")


@dataclass(frozen=True)
class PartitionSpec:
    """How a data set is split over clients; ``alpha`` is for dirichlet, ``num_domains`` for domains.

    ``permute_labels`` gives each client its own label permutation (seed = seed + client index)
    on top of any scheme: the Factorized-FL "permuted labels" setting.
    """

    scheme: Scheme = "iid"
    num_clients: int = 4
    seed: int = 0
    alpha: float = 0.5
    num_domains: int = 2
    permute_labels: bool = False

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown partition scheme {self.scheme!r}; choose one of: {', '.join(SCHEMES)}")
        if self.num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {self.num_clients}")
        if self.scheme == "dirichlet" and not self.alpha > 0:
            raise ValueError(f"dirichlet alpha must be > 0, got {self.alpha}")
        if self.scheme == "domains" and not 1 <= self.num_domains <= self.num_clients:
            raise ValueError(f"num_domains must be in [1, num_clients={self.num_clients}], got {self.num_domains}")


def iid_partition(num_samples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """A shuffled split into near-equal shards."""
    order = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def iid_shard(num_samples: int, num_clients: int, seed: int, client: int) -> np.ndarray:
    """``iid_partition(num_samples, num_clients, seed)[client]`` without splitting and sorting the others."""
    order = np.random.default_rng(seed).permutation(num_samples)
    size, extra = divmod(num_samples, num_clients)  # np.array_split: the first ``extra`` shards hold one more
    start = client * size + min(client, extra)
    return np.sort(order[start : start + size + (client < extra)])


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Per class, shares ~ Dirichlet(alpha) over clients (FedHM's non-IID split).

    The proportions depend only on (seed, number of classes, clients, alpha), not on the labels'
    order or count, so train and test splits made with one seed share them.
    """
    classes = int(labels.max()) + 1 if len(labels) else 0
    rng = np.random.default_rng(seed)
    proportions = rng.dirichlet([alpha] * num_clients, size=classes)
    shards: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for label in range(classes):
        members = np.flatnonzero(labels == label)
        members = members[np.random.default_rng([seed, label]).permutation(len(members))]
        cuts = np.round(np.cumsum(proportions[label])[:-1] * len(members)).astype(int)
        for shard, part in zip(shards, np.split(members, cuts), strict=True):
            shard.append(part)
    return [np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=int) for parts in shards]


def domain_of(client: int, num_clients: int, num_domains: int) -> int:
    """Clients are dealt into contiguous, near-equal groups: one domain per group."""
    bounds = np.array_split(np.arange(num_clients), num_domains)
    return next(d for d, group in enumerate(bounds) if client in group)


def domain_classes(num_classes: int, num_domains: int) -> list[np.ndarray]:
    """Disjoint, contiguous class groups, one per domain."""
    if num_domains > num_classes:
        raise ValueError(f"{num_domains} domains need at least as many classes, got {num_classes}")
    return np.array_split(np.arange(num_classes), num_domains)


def domain_partition(labels: np.ndarray, num_clients: int, num_domains: int, seed: int) -> list[np.ndarray]:
    """Each domain's classes are split IID among that domain's clients; domains share no class."""
    groups = domain_classes(int(labels.max()) + 1, num_domains)
    shards: list[np.ndarray] = [np.empty(0, dtype=int)] * num_clients
    for domain, classes in enumerate(groups):
        members = np.flatnonzero(np.isin(labels, classes))
        clients = [c for c in range(num_clients) if domain_of(c, num_clients, num_domains) == domain]
        for client, part in zip(clients, iid_partition(len(members), len(clients), seed + domain), strict=True):
            shards[client] = members[part]
    return shards


def label_permutation(num_classes: int, seed: int, client: int) -> Tensor:
    """Client ``client``'s label map: new_label = permutation[old_label], seeded by seed + client."""
    return torch.from_numpy(np.random.default_rng(seed + client).permutation(num_classes))


def partition(labels: Tensor | np.ndarray, spec: PartitionSpec) -> list[np.ndarray]:
    """Sample indices of every client (index i of the list is client i)."""
    array = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    if spec.scheme == "iid":
        return iid_partition(len(array), spec.num_clients, spec.seed)
    if spec.scheme == "dirichlet":
        return dirichlet_partition(array, spec.num_clients, spec.alpha, spec.seed)
    return domain_partition(array, spec.num_clients, spec.num_domains, spec.seed)


def client_shard(
    x: Tensor, y: Tensor, spec: PartitionSpec, client: int, num_classes: int | None = None
) -> tuple[Tensor, Tensor]:
    """One client's (inputs, labels), with its label permutation applied when the spec asks for one."""
    if not 0 <= client < spec.num_clients:
        raise ValueError(f"client index must be in [0, {spec.num_clients}), got {client}")
    if spec.scheme == "iid":  # one shard, not all of them: each of 1,000 devices sorted 1,000 shards in round 1
        index = torch.from_numpy(iid_shard(len(y), spec.num_clients, spec.seed, client)).long()
    else:
        index = torch.from_numpy(partition(y, spec)[client]).long()
    labels = y[index]
    if spec.permute_labels:
        labels = label_permutation(num_classes or int(y.max()) + 1, spec.seed, client)[labels]
    return x[index], labels


def capped(split: tuple[Tensor, Tensor], samples: int | None, seed: int) -> tuple[Tensor, Tensor]:
    """At most ``samples`` of a shard, drawn with ``seed`` (shards are disjoint already, so one seed serves all).

    fleet.yaml's ``samples_per_device``: the emulated agent and any engine compared with it keep the same images.
    """
    if samples is None or len(split[1]) <= samples:
        return split
    keep = torch.randperm(len(split[1]), generator=torch.Generator().manual_seed(seed))[:samples]
    return split[0][keep], split[1][keep]
