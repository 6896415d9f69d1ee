"""``strategy.preset`` in fleet.yaml: a paper's training recipe for its strategy, as defaults.

fedfleet's own defaults are sized for small devices and small data (docs/presets.md says where
and why each differs); a preset fills in what the paper and its official code trained with.
Keys written in fleet.yaml always win over the preset's: a preset only fills what is absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    """Keys of fleet.yaml's ``training`` section and of the strategy's ``params``."""

    training: Mapping[str, Any] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)


FACTORIZED_FL_PAPER = Preset(
    # Seed 000 Appendix: SGD, momentum 0.9, lr 1e-3, weight decay 1e-6, batch 256; the official
    # main.py sets the same. Local epochs: 5 (the official scripts take n_eps on the command line).
    training={"optimizer": "momentum", "lr": 1e-3, "weight_decay": 1e-6, "batch_size": 256, "local_epochs": 5},
    # Single-domain reference values (tau 0, eps 1, lambda 5e-4). min_peers is left to the fleet:
    # it is the reference's minimum_aggr minus one, and minimum_aggr depends on the task.
    params={"tau": 0.0, "eps": 1.0, "lambda_sparsity": 5e-4},
)

FEDLORA_PAPER = Preset(
    # Seed 004 Sec. 6 (FedLoRA): Adam, lr 0.002, one local epoch. Sec. 5.1 / Fig. 8: bypasses on the
    # attention projections only, 0.06 M ... 0.44 M trainable parameters at r 2 ... 16, which is
    # 27,648 r on ViT-S: one bypass on the fused qkv projection plus one on proj, the head not
    # counted (so not trained); the reference code scales B A by 1 (alpha = r).
    # Sec. 6: masked cross-entropy in every method, the reference filling absent logits with 0.
    training={"optimizer": "adam", "lr": 2e-3, "local_epochs": 1, "absent_class_fill": "zero"},
    params={"adapter_layout": "fused_qkv", "scale": "one", "train_head": False, "targets": "attn"},
)

PRESETS: dict[str, dict[str, Preset]] = {
    "paper": {
        # Seed 004 Sec. 6 text: SGD momentum 0.9, lr 0.1, 10 local epochs, batch 64, weight decay
        # 5e-4 (its Table 3 says lr 0.01); Frobenius decay 1e-4 as in the official code; masked
        # cross-entropy with absent logits filled with 0, as the official code does.
        "fedhm": Preset(
            training={
                "optimizer": "momentum",
                "lr": 0.1,
                "local_epochs": 10,
                "batch_size": 64,
                "weight_decay": 5e-4,
                "absent_class_fill": "zero",
            },
            params={"frobenius_decay": 1e-4},
        ),
        "factorized_fl": FACTORIZED_FL_PAPER,
        "factorized_fl_beta": FACTORIZED_FL_PAPER,
        "fedlora": FEDLORA_PAPER,
        "lora_homogeneous": FEDLORA_PAPER,  # the paper's Fig. 8 "FedLoRA": one rank on every client
    }
}


def preset_for(preset: str, strategy: str) -> Preset:
    """The ``preset`` recipe of ``strategy``; ``ValueError`` saying which presets exist otherwise."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    by_strategy = PRESETS[preset]
    if strategy not in by_strategy:
        raise ValueError(f"no {preset!r} preset for strategy {strategy!r}; it exists for: {', '.join(by_strategy)}")
    return by_strategy[strategy]


def apply_preset(preset: Preset, training: Mapping[str, Any], params: Mapping[str, Any]) -> tuple[dict, dict]:
    """``training`` and ``params`` with the preset's keys added where fleet.yaml did not set them."""
    return {**preset.training, **training}, {**preset.params, **params}
