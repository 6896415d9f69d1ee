"""FedLoRA on the device: a pre-trained ViT, frozen, with LoRA adapters of the assigned rank (or all of it, ft).

The frozen base arrives once: the first assignment carries it, the device keeps it
(:meth:`LoRAProgram.keep`) and later assignments carry only the adapters and the head. Whichever
copy is used must hash to the spec's ``base_sha256``; a kept copy that does not (or none at all)
raises ``KeptStateMissing``, so the coordinator sends the base again. The upload is the trainable
part only (A, B and the head): a frozen base weight never leaves the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from device_agent.clients.assignment_check import BadAssignment, check_assignment
from device_agent.clients.base import ClientProgram, KeptStateMissing, load_tensors
from device_agent.clients.spec import LoRASpec
from device_agent.layers.lora import (
    ATTENTION_TARGETS,
    MLP_TARGETS,
    apply_lora,
    base_state,
    exchanged_keys,
    lora_scale,
    state_digest,
)
from device_agent.models import build_model

TARGETS = {"attn": ATTENTION_TARGETS, "attn_mlp": ATTENTION_TARGETS + MLP_TARGETS}


class LoRAProgram(ClientProgram):
    Spec: ClassVar[type[LoRASpec]] = LoRASpec
    reuse_model: ClassVar[bool | None] = False  # its load is its own: a fresh model each round
    spec: LoRASpec

    def load(self, tensors: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor] | None) -> None:
        """Adapters from the assignment; the frozen base from it (first round) or from the kept state."""
        spec = self.spec
        if spec.rank is None:
            load_tensors(self.model, tensors)
            return
        base_keys = set(base_state(self.model))
        check_assignment(tensors, self.model.state_dict(), optional=base_keys)
        sent = {k: v for k, v in tensors.items() if k in base_keys}
        if sent:
            base, source, error = sent, "assignment", BadAssignment
        else:
            base, source, error = dict(local or {}), "kept state", KeptStateMissing
        if base.keys() != base_keys:
            raise error(f"the {source} lacks {len(base_keys - base.keys())} frozen base tensors")
        if state_digest(base) != spec.base_sha256:
            raise error(f"the base model in the {source} does not have the assigned digest {spec.base_sha256[:12]}")
        self.model.load_state_dict({**tensors, **base})

    @classmethod
    def build_model(cls, spec: LoRASpec) -> nn.Module:  # type: ignore[override]
        model = build_model(spec.model.arch, spec.model.num_classes, spec.model.in_channels)
        if spec.rank is None:
            return model
        return apply_lora(
            model,
            spec.rank,
            lora_scale(spec.scale, spec.alpha, spec.rank),
            TARGETS[spec.targets],
            trainable=("head",) if spec.train_head else (),
            layout=spec.adapter_layout,
        )

    def upload(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return {key: state[key].detach().clone() for key in exchanged_keys(self.model)}

    def keep(self) -> dict[str, torch.Tensor]:
        """The frozen base, so the next assignment need not carry it (nothing for ft)."""
        if self.spec.rank is None:
            return {}
        return {k: v.detach().clone() for k, v in base_state(self.model).items()}
