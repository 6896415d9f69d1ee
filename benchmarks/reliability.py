"""The reliability tables of docs/reliability.md, rendered from ``python -m benchmarks.faults --json`` output.

``scenarios`` (this benchmark) and ``bad_inputs`` (``benchmarks.bad_inputs``) are rendered when present;
:func:`update_page` replaces what lies between the ``faults`` marker comments, so the tables on the
page are always one measured run, never hand-edited figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BEGIN = "<!-- faults:begin -->"
END = "<!-- faults:end -->"


def _cell(value: Any) -> str:
    if value is None:
        return "not run"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def render(results: Mapping[str, Any]) -> str:
    """Markdown tables for the ``scenarios`` and ``bad_inputs`` keys found in ``results``."""
    parts = []
    scenarios = results.get("scenarios")
    if scenarios:
        rows = ["| fault | survived | lost updates | rounds completed | what happened |", "|---|---|---|---|---|"]
        for name, row in scenarios.items():
            cells = (name, row["survived"], row["lost_updates"], row["rounds_completed"], row["detail"])
            rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("\n".join(rows))
    bad_inputs = results.get("bad_inputs")
    if bad_inputs:
        rows = ["| bad input | refused | reason | round unaffected | what happened |", "|---|---|---|---|---|"]
        for kind, row in bad_inputs.items():
            cells = (kind, row["refused"], row["reason"], row["round_unaffected"], row["detail"])
            rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("\n".join(rows))
    if not parts:
        raise ValueError("nothing to render: expected a 'scenarios' or 'bad_inputs' key")
    return "\n\n".join(parts)


def update_page(text: str, results: Mapping[str, Any]) -> str:
    """``text`` with the block between the marker comments replaced by :func:`render`'s tables."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {BEGIN} ... {END} block to fill")
    return f"{text[: start + len(BEGIN)]}\n{render(results)}\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.reliability", description="write the reliability tables of a docs page"
    )
    parser.add_argument("results", type=Path, help="JSON from python -m benchmarks.faults --json (and bad_inputs)")
    parser.add_argument("--page", type=Path, default=Path("docs/reliability.md"), help="default: %(default)s")
    args = parser.parse_args(argv)
    try:
        results = json.loads(args.results.read_text())
        args.page.write_text(update_page(args.page.read_text(), results))
    except (OSError, ValueError, KeyError) as exc:
        print(f"reliability: error: {exc}", file=sys.stderr)
        return 2
    print(f"updated {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
