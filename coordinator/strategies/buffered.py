"""A round aggregate that validates and keeps each client's upload until the round closes.

Personalized strategies need every upload of a round at once (similarities are pairwise, factor
analysis is over all clients), so they buffer instead of folding. What they buffer is what their
clients send: u vectors for Factorized-FL, a model per client for SimFed and FedFac.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from coordinator.algorithms.aggregation import UpdateRejected, check_values
from coordinator.strategies.base import ClientSlot, RosterRound


@dataclass(frozen=True)
class Upload:
    client_id: str
    tensors: dict[str, torch.Tensor]
    num_samples: int
    extras: dict[str, torch.Tensor]


def _check(kind: str, got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(got))
    if missing:
        raise UpdateRejected(
            f"{kind} lacks {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            "missing_tensor",
        )
    for key, value in got.items():
        if key not in expected:
            raise UpdateRejected(f"{kind} {key!r}: not expected from this client", "unknown_tensor")
        if not isinstance(value, torch.Tensor):
            raise UpdateRejected(f"{kind} {key!r}: expected a tensor, got {type(value).__name__}")
        want = expected[key]
        if value.shape != want.shape:
            raise UpdateRejected(
                f"{kind} {key!r}: shape {tuple(value.shape)}, expected {tuple(want.shape)}", "bad_shape"
            )
        if value.is_floating_point() != want.is_floating_point():
            raise UpdateRejected(f"{kind} {key!r}: dtype {value.dtype}, expected {want.dtype}", "bad_dtype")
        if value.is_floating_point():
            check_values(f"{kind} {key}", value, want.dtype)


class BufferedRound(RosterRound):
    """Accepts one upload per round participant, whose keys and shapes match ``expected``.

    ``expected`` and ``expected_extras`` map key -> a tensor of the right shape and kind (float or
    not); values are never read.
    """

    def __init__(
        self,
        round: int,
        clients: Sequence[ClientSlot],
        expected: Mapping[str, torch.Tensor],
        expected_extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(round, clients)
        self.expected = expected
        self.expected_extras = dict(expected_extras or {})
        self.uploads: dict[str, Upload] = {}

    def check(
        self,
        client_id: str,
        tensors: dict[str, torch.Tensor],
        num_samples: int,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.slot_of(client_id, num_samples)
        _check("upload", tensors, self.expected)
        _check("extras", extras or {}, self.expected_extras)

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
