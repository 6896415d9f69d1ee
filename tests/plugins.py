"""A plugin package installed for one test: its modules and a ``*.dist-info`` with entry points on sys.path.

That is what ``pip install`` leaves, so ``importlib.metadata.entry_points`` finds it like any installed
package; everything is taken away again on the way out (the path entry and the modules it imported).
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def installed_plugin(
    folder: Path, name: str, entry_points: Mapping[str, Mapping[str, str]], modules: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Install package ``name`` in ``folder``: ``modules`` (module name -> source) and ``entry_points`` (group ->
    entry name -> module) while the block runs."""
    modules = modules or {}
    for module, source in modules.items():
        (folder / f"{module}.py").write_text(textwrap.dedent(source))
    info = folder / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "\n".join(
            f"[{group}]\n" + "".join(f"{entry} = {target}\n" for entry, target in entries.items())
            for group, entries in entry_points.items()
        )
    )
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        for module in modules:
            sys.modules.pop(module, None)
