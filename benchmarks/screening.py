"""The upload gate's screening in the method benchmarks: off, so that they measure the methods, not the gate.

A simulated fleet gets fleet.yaml's default ``limits``, and those screen honest updates too: the update
bound clips each layer beyond 1.5 x the fleet's median update, and the peer check refuses an update that
points away from the round's others. On non-IID splits both act on honest clients: in a 5-seed
Fashion-MNIST run of ``benchmarks.compare`` (hetero-devices, FedHM and HeteroFL, Dirichlet 0.5 and 0.1,
commit 71cebd6) 25 honest updates were refused and 19 of 60 rounds failed (a simulation's quorum is
every client), so its accuracies measured the defences as much as the strategies. The defences are
measured on their own by ``benchmarks.poisoning`` (docs/robust-aggregation.md); ``--screening`` runs a
method benchmark under the defaults instead.
"""

from __future__ import annotations

OFF: dict[str, object] = {"update_bound_factor": None, "peer_min_cosine": None, "peer_hard_floor": None}
"""fleet.yaml ``limits`` that turn the screening off: no update bound (no clipping), no peer check. The bounds
on absurd values (the norm bound at 10 x what was sent, the meta checks) stay; a round that still lost an
update shows in the benchmark's ``failed_rounds``."""


def limits(screening: bool) -> dict[str, object]:
    """fleet.yaml ``limits`` for a method benchmark: the defaults with ``screening``, else :data:`OFF`."""
    return {} if screening else dict(OFF)
