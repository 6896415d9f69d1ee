"""LoRA: a frozen pre-trained linear layer plus a trainable low-rank bypass (FedLoRA, FedHM paper Sec. 5).

``y = x W^T + b + scale * x A^T B^T`` with W, b frozen, A (r x in) and B (out x r) trained,
``scale = alpha / r``. The factors use FedHM's names and shapes (``reduce`` = A is (r, in),
``expand`` = B is (out, r), as in ``FactorizedLinear``), so ``expand @ reduce`` is the layer's
update and the server treats a client's adapters like FedHM factors: rebuild, average,
re-factorize. B starts at zero, so a fresh adapter leaves the pre-trained model unchanged.

The frozen base is kept as ``requires_grad=False`` parameters rather than buffers: the optimizer
never sees them, the cost model counts no gradient or optimizer state for them, and autograd does
not count them as saved activations.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ATTENTION_TARGETS = ("q", "k", "v", "proj")
"""W^Q, W^K, W^V, W^O of every attention block: the paper's FedLoRA targets."""
MLP_TARGETS = ("fc1", "fc2")
FACTORS = ("reduce", "expand")
"""What a LoRA layer exchanges: A and B. Its frozen ``weight`` and ``bias`` never leave the device."""


class LoRALinear(nn.Module):
    """A frozen linear layer with a rank-``rank`` bypass scaled by ``alpha / rank``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        if not 1 <= rank <= min(base.in_features, base.out_features):
            raise ValueError(f"LoRA rank must be in [1, {min(base.in_features, base.out_features)}], got {rank}")
        self.in_features, self.out_features, self.rank = base.in_features, base.out_features, rank
        self.scale = alpha / rank
        self.weight = nn.Parameter(base.weight.detach(), requires_grad=False)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach(), requires_grad=False)
        device = base.weight.device
        self.reduce = nn.Parameter(torch.empty(rank, base.in_features, device=device))
        self.expand = nn.Parameter(torch.zeros(base.out_features, rank, device=device))
        self.merged = False
        if device.type != "meta":
            nn.init.kaiming_uniform_(self.reduce, a=math.sqrt(5))

    def delta(self) -> Tensor:
        """The update the bypass adds to W: scale * B A."""
        return self.scale * (self.expand @ self.reduce)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the bypass into W (inference without the extra matmuls); forward is unchanged."""
        if not self.merged:
            self.weight += self.delta()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo :meth:`merge`, so training goes on with W back at its pre-trained value."""
        if self.merged:
            self.weight -= self.delta()
            self.merged = False

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.merged:
            return out
        return out + self.scale * F.linear(F.linear(x, self.reduce), self.expand)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, scale={self.scale:g}"


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(
    model: nn.Module, rank: int, alpha: float, targets: Iterable[str], trainable: Iterable[str] = ("head",)
) -> nn.Module:
    """Freeze ``model`` and put a LoRA bypass on every linear whose last name is in ``targets``.

    Modules named in ``trainable`` (by their full name, e.g. the classifier ``head``) stay trainable:
    a new task needs a new head. Returns ``model``, changed in place.
    """
    targets, trainable = set(targets), set(trainable)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    chosen = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    if not chosen:
        raise ValueError(f"{type(model).__name__} has no linear layer named {sorted(targets)}")
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoRALinear(module, rank, alpha))
    for name in trainable:
        for parameter in model.get_submodule(name).parameters():
            parameter.requires_grad_(True)
    return model


def exchanged_keys(model: nn.Module) -> list[str]:
    """State-dict keys of what a LoRA model exchanges: its trainable parameters (A, B and the head)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def base_state(model: nn.Module) -> dict[str, Tensor]:
    """The frozen pre-trained part of a LoRA model: everything it does not exchange."""
    exchanged = set(exchanged_keys(model))
    return {k: v for k, v in model.state_dict().items() if k not in exchanged}


def state_digest(tensors: Mapping[str, Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes: the identity of a distributed base model."""
    digest = hashlib.sha256()
    for key in sorted(tensors):
        value = tensors[key].detach().contiguous().cpu()
        digest.update(f"{key}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


__all__ = [
    "ATTENTION_TARGETS",
    "FACTORS",
    "MLP_TARGETS",
    "LoRALinear",
    "apply_lora",
    "base_state",
    "exchanged_keys",
    "lora_layers",
    "state_digest",
]
