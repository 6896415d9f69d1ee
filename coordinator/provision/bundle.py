"""Builder 5: ``kits/<device>.tar.gz``, the kit as one file (0600: it holds the device's secrets)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from coordinator.transport.broker.credentials import write_file


def build_bundle(folder: Path, out: Path) -> Path:
    """Tar ``folder`` as ``<name>/...``, keeping each file's mode; owners are reset so it unpacks as anyone."""

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(folder, arcname=folder.name, filter=clean)
    write_file(out, buffer.getvalue(), 0o600)
    return out
