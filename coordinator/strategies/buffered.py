"""A round aggregate that keeps each client's upload until the round closes.

Personalized strategies need every upload of a round at once (similarities are pairwise, factor
analysis is over all clients), so they buffer instead of folding. What they buffer is what their
clients send: u vectors for Factorized-FL, a model per client for SimFed and FedFac.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from coordinator.strategies.base import ClientSlot, RosterRound


@dataclass(frozen=True)
class Upload:
    client_id: str
    tensors: dict[str, torch.Tensor]
    num_samples: int
    extras: dict[str, torch.Tensor]


class BufferedRound(RosterRound):
    """Keeps one upload per round participant (its strategy's ``upload_contract`` says what each holds)."""

    def __init__(self, round: int, clients: Sequence[ClientSlot]) -> None:
        super().__init__(round, clients)
        self.uploads: dict[str, Upload] = {}

    def fold(
        self,
        client_id: str,
        tensors: dict[str, torch.Tensor],
        num_samples: int,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.uploads[client_id] = Upload(
            client_id,
            {k: v.detach().clone() for k, v in tensors.items()},
            num_samples,
            {k: v.detach().clone() for k, v in (extras or {}).items()},
        )
        self.received.append(client_id)

    def ordered(self) -> list[Upload]:
        """Uploads in client-id order: what makes every result independent of arrival order."""
        return [self.uploads[cid] for cid in sorted(self.uploads)]


def sample_weights(uploads: Sequence[Upload]) -> torch.Tensor:
    counts = torch.tensor([u.num_samples for u in uploads], dtype=torch.float64)
    return counts / counts.sum()


def weighted_mean(uploads: Sequence[Upload], key: str, weights: torch.Tensor) -> torch.Tensor:
    stacked = torch.stack([u.tensors[key].to(torch.float64) for u in uploads])
    mean = torch.tensordot(weights, stacked, dims=1)
    return mean.to(uploads[0].tensors[key].dtype)


def split_client_key(key: str, prefix: str) -> tuple[str, str]:
    """``<prefix>/<client id>/<tensor key>`` -> (client id, tensor key); client ids may hold '/'."""
    client, _, name = key[len(prefix) + 1 :].rpartition("/")
    return client, name


def unprefixed(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The ``<prefix>/<key>`` entries of a flat state dict, as copies keyed by ``<key>``."""
    start = len(prefix) + 1
    return {k[start:]: v.clone() for k, v in state.items() if k.startswith(f"{prefix}/")}


def client_states(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The per-client ``client/<id>/<key>`` entries of a flat state dict, grouped by client."""
    personal: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith("client/"):
            client, name = split_client_key(key, "client")
            personal.setdefault(client, {})[name] = value.clone()
    return personal
