"""The part of a personalized model that never leaves the device, kept on disk between rounds.

Factorized-FL's v, mu, biases, BatchNorm and classifier exist only on the device: if they lived in
memory alone, an agent restart (kill -9, reboot, ``coordinator emulate`` resumed) would lose them and
the coordinator's next, partial assignment could not be trained. They are written atomically after
every round, one safetensors file per run, so a new run never starts from another run's weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from device_agent.common.atomic import atomic_write
from device_agent.wire.codec import CodecError, decode_tensors, encode_tensors

log = logging.getLogger("fedfleet.agent")

SUFFIX = ".kept.safetensors"


class KeptStore:
    """``<folder>/<run>.kept.safetensors``: the latest kept state of the one run this device is in."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, run: str) -> Path:
        return self.folder / f"{run}{SUFFIX}"

    def load(self, run: str) -> dict[str, Tensor] | None:
        """What the device kept in ``run``; None if nothing (or only an unreadable file, which is logged)."""
        path = self._path(run)
        if not path.exists():
            return None
        try:
            return decode_tensors(path.read_bytes())
        except CodecError as exc:
            log.error("%s is unreadable, so this device starts without its kept state: %s", path, exc)
            return None

    def save(self, run: str, tensors: Mapping[str, Tensor]) -> None:
        """Replace the state kept for ``run`` and drop other runs' (one run at a time per device)."""
        if not tensors:
            return
        atomic_write(self._path(run), encode_tensors(tensors))
        for other in self.folder.glob(f"*{SUFFIX}"):
            if other != self._path(run):
                other.unlink(missing_ok=True)
