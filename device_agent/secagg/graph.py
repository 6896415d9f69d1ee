"""SecAgg+'s sparse communication graph (Bell et al. 2020): each device shares secrets with and masks against
its ``neighbours`` graph neighbours only, so its cost grows with log n instead of n.

The graph is a Harary graph H(k, n) (the circulant graph linking each node to the k/2 nearest on either side of
a ring) laid over a random order of the participants; both sides derive the order from the round's seed,
so a device can check the neighbourhood the coordinator tells it. k must be even (a circulant graph of odd
degree needs n even), or n - 1, the complete graph of the base protocol (Bonawitz et al. 2017).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Mapping, Sequence

from device_agent.secagg.errors import ParameterError

MIN_DEVICES = 3


def validate(devices: int, threshold: int, neighbours: int) -> None:
    """Raise ``ParameterError`` naming the parameter if (threshold, neighbours) cannot run with ``devices``."""
    if devices < MIN_DEVICES:
        raise ParameterError(f"devices: secure aggregation needs at least {MIN_DEVICES} devices, got {devices}")
    if not 2 <= neighbours <= devices - 1:
        raise ParameterError(
            f"neighbours: must be in 2..{devices - 1} (devices - 1) for {devices} devices, got {neighbours}"
        )
    if neighbours % 2 and neighbours != devices - 1:
        raise ParameterError(f"neighbours: must be even (or devices - 1 = {devices - 1}), got {neighbours}")
    if not 2 <= threshold <= neighbours:
        raise ParameterError(f"threshold: must be in 2..{neighbours} (the neighbours), got {threshold}")


def suggested(devices: int) -> tuple[int, int]:
    """A default (threshold, neighbours): k the even number >= 3 log2(n) (at most n - 1), t a strict majority of k.

    A starting point, not a guarantee: with a dropout rate d a device needs t of its k neighbours alive at the
    last stage, so raise k (or lower t) for fleets that lose many devices mid-round.
    """
    if devices < MIN_DEVICES:
        raise ParameterError(f"devices: secure aggregation needs at least {MIN_DEVICES} devices, got {devices}")
    k = 2 * math.ceil(1.5 * math.log2(devices))
    k = devices - 1 if k >= devices - 1 else k
    return k // 2 + 1, k


def ring_order(participants: Sequence[str], seed: bytes) -> list[str]:
    """The participants in the ring order the graph is laid over: a shuffle drawn from ``seed``."""
    order = sorted(set(participants))
    if len(order) != len(participants):
        raise ParameterError("participants: device ids must be distinct")
    random.Random(int.from_bytes(hashlib.sha256(seed).digest(), "big")).shuffle(order)
    return order


def neighbour_graph(participants: Sequence[str], neighbours: int, seed: bytes) -> dict[str, frozenset[str]]:
    """Each participant's neighbours: H(neighbours, n) over the participants in an order drawn from ``seed``."""
    order = ring_order(participants, seed)
    n = len(order)
    if not 2 <= neighbours <= n - 1 or (neighbours % 2 and neighbours != n - 1):
        raise ParameterError(f"neighbours: {neighbours} is not a valid degree for {n} devices (even, 2..{n - 1})")
    if neighbours == n - 1:
        return {device: frozenset(order) - {device} for device in order}
    links: dict[str, set[str]] = {device: set() for device in order}
    for i, device in enumerate(order):
        for offset in range(1, neighbours // 2 + 1):
            other = order[(i + offset) % n]
            links[device].add(other)
            links[other].add(device)
    return {device: frozenset(peers) for device, peers in links.items()}


def components(graph: Mapping[str, frozenset[str]], members: Iterable[str]) -> list[set[str]]:
    """The connected components of ``graph`` restricted to ``members``, largest first."""
    left, found = set(members), []
    while left:
        start = left.pop()
        component, frontier = {start}, [start]
        while frontier:
            for peer in graph[frontier.pop()] & left:
                left.discard(peer)
                component.add(peer)
                frontier.append(peer)
        found.append(component)
    return sorted(found, key=len, reverse=True)
