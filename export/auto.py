"""Exports at the end of a run, as fleet.yaml's ``export:`` section asks::

    export:
      merged: true            # the global model at full rank
      ratios: [1/2, 1/4]      # FedHM hybrid models (each one of the fleet's ratios)
      personal: [pi5-01]      # devices' personalized models (personalized strategies), or "all"
      quantize: false         # also an int8 copy of each, with its test accuracy
      opset: 18
      dir: exports            # relative to the run directory

Files are named ``merged.onnx``, ``ratio-1_4.onnx``, ``personal-<device>.onnx``. A failed export is
reported and the others still run: the training run itself has already succeeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from export.targets import ExportError, TrainedRun, parse_ratio, ratio_text, target_label


class ExportSettings(BaseModel):
    """fleet.yaml ``export:``; the fleet checks ratios and device ids against its own."""

    model_config = ConfigDict(extra="forbid")

    merged: bool = Field(True, description="the merged global model")
    ratios: list[float] = Field(default_factory=list, description="rank ratios whose hybrid model is exported")
    personal: list[str] | Literal["all"] = Field(default_factory=list, description="device ids, or 'all'")
    quantize: bool = Field(False, description="also an int8 dynamically quantized copy of each file")
    opset: int = Field(18, ge=9, le=23, description="ONNX opset")
    dir: Path = Field(Path("exports"), description="where the files go, relative to the run directory")

    @field_validator("ratios", mode="before")
    @classmethod
    def _parse_ratios(cls, values: Any) -> Any:
        if not isinstance(values, list):
            return values
        try:
            return [parse_ratio(v) for v in values]
        except ExportError as error:
            raise ValueError(str(error)) from None

    def problems(self, ratios: Sequence[float], devices: Sequence[str], personalized: bool, rank: bool) -> list[str]:
        """What does not fit the fleet (its ratios, device ids and strategy), one message each."""
        out = []
        if self.ratios and not rank:
            out.append("ratios: the strategy has no rank levels (only fedhm does); use merged")
        for ratio in self.ratios:
            if not any(abs(ratio - r) < 1e-9 for r in ratios):
                out.append(f"ratios: {ratio_text(ratio)} is not one of the fleet's ratios")
        if self.personal and not personalized:
            out.append("personal: the strategy is not personalized; every device uses the merged model")
        for device in [] if self.personal == "all" else self.personal:
            if device not in devices:
                out.append(f"personal: {device!r} is not a device of this fleet")
        return out


def _file_name(target: str) -> str:
    return target.replace(":", "-").replace("/", "_") + ".onnx"


def export_configured(run: TrainedRun, settings: ExportSettings) -> list[str]:
    """Run every configured export of ``run``; returns one readable line per file (or failure)."""
    from export.check import ParityError
    from export.runner import ExportOptions, export_run

    requests: list[dict[str, Any]] = [{"merged": True}] if settings.merged else []
    requests += [{"ratio": r} for r in settings.ratios if r != 1.0 or not settings.merged]
    personal = run.personal_devices if settings.personal == "all" else settings.personal
    requests += [{"personal": d} for d in personal]
    lines = []
    for request in requests:
        kind = "merged" if "merged" in request else "ratio" if "ratio" in request else "personal"
        label = target_label(kind, request.get("ratio"), request.get("personal"))
        out = run.path / settings.dir / _file_name(label)
        try:
            options = ExportOptions(out=out, opset=settings.opset, quantize=settings.quantize, **request)
            record = export_run(run, options)
        except (ExportError, ParityError, ValueError) as error:
            lines.append(f"export {label}: FAILED: {error}")
            continue
        lines.append(
            f"export {label}: {out} ({record.bytes / 2**20:.2f} MiB, max abs diff {record.max_abs_diff:.1e}, "
            f"{record.latency_ms_b1:.2f} ms at batch 1)"
        )
    return lines
