"""``RUN_DIR/exports.jsonl``: one line per exported file, read by the run report (json only, no onnx)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EXPORTS_FILE = "exports.jsonl"


def read_exports(run_dir: Path) -> list[dict[str, Any]]:
    """The run's export records, oldest first (a torn last line is skipped)."""
    path = Path(run_dir) / EXPORTS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def table_rows(records: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Report rows: file, target, round, size, parity, latency, int8 accuracy next to fp32."""
    rows = []
    for r in records:
        latency = "-" if r.get("latency_ms_b1") is None else f"{r['latency_ms_b1']:.2f} / {r['latency_ms_b32']:.2f}"
        int8 = r.get("int8")
        quantized = "-" if not int8 else f"{int8['accuracy']:.4f} vs {r['accuracy']:.4f} ({int8['bytes']:,} B)"
        rows.append(
            (
                r["file"],
                r["target"],
                str(r["round"]),
                f"{r['bytes']:,}",
                f"{r['max_abs_diff']:.1e} / {r['top1_agreement']:.0%}",
                latency,
                quantized,
            )
        )
    return rows


TABLE_HEADER = (
    "file",
    "model",
    "round",
    "bytes",
    "max abs diff / top-1 agreement",
    "ms batch 1 / 32",
    "int8 accuracy vs fp32",
)
