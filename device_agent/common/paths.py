"""Paths written in a config file are relative to that file, not to wherever the process was started.

An agent started by systemd runs in ``/``; a coordinator started from a script runs wherever the
script was. Anchoring a file's relative paths at the file's own folder makes agent.yaml and
fleet.yaml mean the same thing from any working directory. Flags on the command line keep the
usual meaning (relative to the working directory): they are resolved by the shell's user, not a file.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any

PROFILES_ENV = "FEDFLEET_PROFILES"
"""Folders of device profiles (``os.pathsep``-separated) that come after the shipped ones and before a config's."""


def anchor(value: Any, base: Path) -> Any:
    """``value`` as a path anchored at ``base`` when it is a relative path string; anything else unchanged."""
    if not isinstance(value, str | Path) or not str(value):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else base / path)


def anchor_secret(ref: Any, base: Path) -> Any:
    """A ``file:PATH`` secret reference with PATH anchored at ``base``; ``env:`` and bad references unchanged."""
    if isinstance(ref, str) and ref.startswith("file:") and len(ref) > len("file:"):
        return f"file:{anchor(ref[len('file:') :], base)}"
    return ref


def anchor_keys(section: Any, keys: tuple[str, ...], base: Path, secrets: tuple[str, ...] = ()) -> None:
    """Anchor ``keys`` (paths) and ``secrets`` (references) of a mapping in place; anything else is for validation."""
    if not isinstance(section, MutableMapping):
        return
    for key in keys:
        if key in section:
            section[key] = anchor(section[key], base)
    for key in secrets:
        if key in section:
            section[key] = anchor_secret(section[key], base)


def profile_files(directory: Path) -> list[Path]:
    """The ``*.yaml``/``*.yml`` files of a folder of device profiles, in name order (later ones win a name).

    The one discovery rule for the coordinator's catalog and the emulator's profiles; a folder that
    is not there is a ``NotADirectoryError`` naming it, not an empty fleet.
    """
    if not directory.is_dir():
        raise NotADirectoryError(f"profile directory {directory} does not exist")
    return sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])


def shipped_profile_dir() -> Path | None:
    """The ``profiles/devices`` folder installed with fedfleet, found without importing the package."""
    spec = importlib.util.find_spec("profiles")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "devices"
    return folder if folder.is_dir() else None


def profile_dirs(extra: Iterable[Path] = (), shipped: bool = True) -> list[Path]:
    """Profile folders in increasing precedence: shipped, ``$FEDFLEET_PROFILES``, then ``extra``.

    The one search order of the coordinator's catalog and the emulator's profiles, so a name means the same
    profile to both.
    """
    found = shipped_profile_dir() if shipped else None
    env = [Path(part) for part in os.environ.get(PROFILES_ENV, "").split(os.pathsep) if part]
    return [*([found] if found else []), *env, *(Path(d) for d in extra)]
