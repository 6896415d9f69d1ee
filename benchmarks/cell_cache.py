"""Finished cells of a long comparison kept on disk, so a run stopped part-way resumes where it stopped.

The full Fashion-MNIST comparison is 162 cells of one to four minutes each on a core: a killed or
timed-out run must not throw away hours of finished cells. The file is JSON lines: a header with the
run's configuration (a cell from another configuration is not the same measurement, so a mismatch is
an error) and its provenance (commit, dirty flag, CPU, torch: see :func:`benchmarks.machine.describe`),
then one line per finished cell, appended and flushed as it finishes, with the commit (and dirty flag) of the
run that computed it. Cells of another commit are refused unless the caller allows them: a resumed run would
otherwise mix two versions of the code in one table, and when allowed, :meth:`CellCache.commits` says which
commits a table's cells come from.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any


class CacheMismatch(ValueError):
    """The cache file was written by a run with another configuration."""


class CellCache:
    def __init__(
        self,
        path: Path,
        config: dict[str, Any],
        provenance: dict[str, Any] | None = None,
        allow_other_commit: bool = False,
    ) -> None:
        self.path = path
        self.config = config
        self.rows: dict[str, dict[str, Any]] = {}
        self.written_by: dict[str, str] = {}
        self.source = _source(provenance or {})
        header: dict[str, Any] = {"config": config, "provenance": provenance}
        if path.exists() and path.stat().st_size:
            lines = path.read_text().splitlines()
            found = _parse(lines[0])
            theirs = found.get("config") if isinstance(found, dict) else None
            if theirs != config:
                theirs = theirs if isinstance(theirs, dict) else {}
                differ = sorted(k for k in config.keys() | theirs.keys() if config.get(k) != theirs.get(k))
                raise CacheMismatch(
                    f"{path} holds cells of another configuration (differs in: {', '.join(differ) or 'its header'}); "
                    "move it away or give another --cache"
                )
            written = (found.get("provenance") or {}) if isinstance(found, dict) else {}
            ours = provenance or {}
            same = ("commit", "dirty", "changes_sha256")
            if not allow_other_commit and any(written.get(key) != ours.get(key) for key in same):
                raise CacheMismatch(
                    f"{path} holds cells of commit {written.get('commit') or 'unknown'}"
                    f"{' (dirty)' if written.get('dirty') else ''}, this checkout is {ours.get('commit') or 'unknown'}"
                    f"{' (dirty)' if ours.get('dirty') else ''}"
                    f"{' with other uncommitted changes' if written.get('commit') == ours.get('commit') else ''}"
                    ": resuming would mix two versions of the code; "
                    "move it away, or --allow-other-commit to keep its cells"
                )
            header = found
            for line in lines[1:]:
                entry = _parse(line)
                if isinstance(entry, dict) and isinstance(entry.get("row"), dict) and "cell" in entry:
                    self.rows[entry["cell"]] = entry["row"]
                    # Cells written before cells carried their commit are the header's (the run that made the file).
                    self.written_by[entry["cell"]] = entry.get("source") or _source(written)
        # Rewritten whole: a line a kill cut short is dropped instead of glued to the next one.
        body = [json.dumps(header)] + [self._line(cell) for cell in self.rows]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(body) + "\n")

    def get(self, cell: str) -> dict[str, Any] | None:
        return self.rows.get(cell)

    def put(self, cell: str, row: dict[str, Any]) -> None:
        self.rows[cell] = row
        self.written_by[cell] = self.source
        with self.path.open("a") as out:
            out.write(self._line(cell) + "\n")
            out.flush()
            os.fsync(out.fileno())

    def commits(self, cells: list[str]) -> dict[str, int]:
        """How many of ``cells`` each commit computed (``+dirty`` marks a tree with uncommitted changes)."""
        return dict(Counter(self.written_by.get(cell, "unknown") for cell in cells if cell in self.rows))

    def _line(self, cell: str) -> str:
        return json.dumps({"cell": cell, "row": self.rows[cell], "source": self.written_by[cell]})


def _source(provenance: dict[str, Any]) -> str:
    """A cell's commit as one string: the commit, ``+dirty`` (and the changes' hash) when the tree had edits."""
    commit = provenance.get("commit") or "unknown"
    if not provenance.get("dirty"):
        return commit
    changes = provenance.get("changes_sha256")
    return f"{commit}+dirty" + (f":{changes[:12]}" if changes else "")


def _parse(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


__all__ = ["CacheMismatch", "CellCache"]
