"""LoRA: a frozen pre-trained linear layer plus a trainable low-rank bypass (FedLoRA, FedHM paper Sec. 5).

``y = base(x) + scale * x A^T B^T`` with the base frozen, A (r x in) and B (out x r) trained. The
factors use FedHM's names and shapes (``reduce`` = A is (r, in), ``expand`` = B is (out, r), as in
``FactorizedLinear``), so ``expand @ reduce`` is the layer's update and the server treats a client's
adapters like FedHM factors: rebuild, average, re-factorize. B starts at zero, so a fresh adapter
leaves the pre-trained model unchanged.

As in Hugging Face PEFT, a LoRA layer WRAPS its base module (``base_layer``, frozen) instead of
copying its weight: an fp16 or quantized base stays what it is, and only the bypass is float32.
The state dict keeps the plain model's keys (``attn.q.weight``, not ``attn.q.base_layer.weight``):
the frozen base a device receives, keeps and hashes, and the checkpoints ``coordinator pretrain``
writes, are the plain model's tensors under their own names.

Two adapter layouts (``LAYOUTS``):

- ``separate``: one bypass per target linear (W^Q, W^K, W^V, W^O each its own A, B).
- ``fused_qkv``: the paper's and the reference code's layout (timm's fused ``qkv`` projection): one
  bypass of A (r, d), B (3d, r) shared by q, k and v (registered as ``attn.qkv``, each of q, k, v
  adds its row block of B A), and one on ``proj``. A ViT-S then trains 27,648 r parameters, not
  36,864 r.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ATTENTION_TARGETS = ("q", "k", "v", "proj")
"""W^Q, W^K, W^V, W^O of every attention block: the paper's FedLoRA targets."""
MLP_TARGETS = ("fc1", "fc2")
FACTORS = ("reduce", "expand")
"""What a LoRA layer exchanges: A and B. Its frozen base never leaves the device."""
QKV = ("q", "k", "v")
LAYOUTS = ("separate", "fused_qkv")
Layout = Literal["separate", "fused_qkv"]
Scale = Literal["alpha_over_r", "one", "rslora"]
"""alpha_over_r: alpha / r (LoRA paper); one: 1 (FedHM reference code, alpha = r); rslora: alpha / sqrt(r)."""


def lora_scale(kind: Scale, alpha: float, rank: int) -> float:
    """The factor the bypass B A is multiplied by."""
    if kind == "alpha_over_r":
        return alpha / rank
    if kind == "one":
        return 1.0
    if kind == "rslora":
        return alpha / math.sqrt(rank)
    raise ValueError(f"scale: unknown kind {kind!r}; choose one of alpha_over_r, one, rslora")


class LoRAAdapter(nn.Module):
    """The trainable bypass alone: ``scale * B A``, A Kaiming-uniform and B zero at init."""

    def __init__(
        self, in_features: int, out_features: int, rank: int, scale: float, device: torch.device | None = None
    ) -> None:
        super().__init__()
        if not 1 <= rank <= min(in_features, out_features):
            raise ValueError(f"LoRA rank must be in [1, {min(in_features, out_features)}], got {rank}")
        self.in_features, self.out_features, self.rank, self.scale = in_features, out_features, rank, scale
        self.reduce = nn.Parameter(torch.empty(rank, in_features, device=device))
        self.expand = nn.Parameter(torch.zeros(out_features, rank, device=device))
        if self.reduce.device.type != "meta":
            nn.init.kaiming_uniform_(self.reduce, a=math.sqrt(5))

    def delta(self, rows: slice = slice(None)) -> Tensor:
        """The update the bypass adds to the base weight (``rows``: a block of it): scale * B A."""
        return self.scale * (self.expand[rows] @ self.reduce)

    def bypass(self, x: Tensor, rows: slice = slice(None)) -> Tensor:
        return self.scale * F.linear(F.linear(x.to(self.reduce.dtype), self.reduce), self.expand[rows])

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, scale={self.scale:g}"


def _flatten_base_keys(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: ``<prefix>base_layer.weight`` is saved as ``<prefix>weight``."""
    inner = f"{prefix}base_layer."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key.removeprefix(inner)] = state.pop(key)


def _nest_base_keys(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: the inverse of :func:`_flatten_base_keys`."""
    own = {f"{prefix}{name}" for name, _ in module.named_parameters(recurse=False)}
    own |= {f"{prefix}{name}" for name, _ in module.named_buffers(recurse=False)}
    for key in [k for k in state if k.startswith(prefix) and k not in own]:
        rest = key.removeprefix(prefix)
        if not rest.startswith("base_layer."):
            state[f"{prefix}base_layer.{rest}"] = state.pop(key)


class _Wrapper(nn.Module):
    """What both LoRA layers share: the frozen base module, the key mapping, merge with a finiteness check."""

    merged: bool
    delta: Callable[[], Tensor]
    """The update the bypass adds to the base weight; each wrapper defines it (its own adapter or a slice)."""

    def _wrap(self, base: nn.Module, name: str) -> None:
        for parameter in base.parameters():
            parameter.requires_grad_(False)
        self.base_layer = base
        self.name = name
        self.merged = False
        self.register_state_dict_post_hook(_flatten_base_keys)
        self.register_load_state_dict_pre_hook(_nest_base_keys)

    def _base_weight(self) -> Tensor:
        weight = getattr(self.base_layer, "weight", None)
        if not isinstance(weight, Tensor) or not weight.is_floating_point():
            kind = type(self.base_layer).__name__
            raise TypeError(f"LoRA layer {self.name or '?'}: cannot merge into a {kind} base (no float weight)")
        return weight

    @torch.no_grad()
    def merge(self) -> None:
        """Fold scale * B A into the base weight (inference without the bypass); forward is unchanged.

        Refuses, naming the layer, when the merged weight would not be finite in the base's dtype
        (a diverged adapter, or an fp16 base overflowing), and leaves the base untouched then.
        """
        if self.merged:
            return
        weight = self._base_weight()
        merged = (weight.float() + self.delta().float()).to(weight.dtype)
        if not bool(torch.isfinite(merged).all()):
            raise ValueError(
                f"LoRA layer {self.name or '?'}: merging gives non-finite weights in {weight.dtype}"
                f" (adapter max |B A| {float(self.delta().abs().max()):.3g}); the base is left unmerged"
            )
        weight.copy_(merged)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo :meth:`merge`, so training goes on with the base back at its pre-trained value."""
        if self.merged:
            weight = self._base_weight()
            weight.copy_((weight.float() - self.delta().float()).to(weight.dtype))
            self.merged = False

    def _base_forward(self, x: Tensor) -> Tensor:
        weight = getattr(self.base_layer, "weight", None)
        if isinstance(weight, Tensor) and weight.is_floating_point() and weight.dtype != x.dtype:
            return self.base_layer(x.to(weight.dtype)).to(x.dtype)
        return self.base_layer(x)


class LoRALinear(_Wrapper, LoRAAdapter):
    """A frozen base linear (wrapped, any dtype) with its own rank-``rank`` bypass scaled by ``scale``."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, name: str = "") -> None:
        LoRAAdapter.__init__(self, base.in_features, base.out_features, rank, scale, _device_of(base))
        self._wrap(base, name)

    def delta(self, rows: slice = slice(None)) -> Tensor:
        return LoRAAdapter.delta(self, rows)

    def forward(self, x: Tensor) -> Tensor:
        out = self._base_forward(x)
        return out if self.merged else out + self.bypass(x).to(out.dtype)


class LoRASlice(_Wrapper):
    """A frozen base linear whose bypass is a block of rows of a shared adapter (fused_qkv's q, k, v).

    The shared adapter is registered once, on the parent (``attn.qkv``); the slice only refers to it.
    """

    def __init__(self, base: nn.Linear, adapter: LoRAAdapter, rows: slice, adapter_name: str, name: str = "") -> None:
        super().__init__()
        self._wrap(base, name)
        self.__dict__["adapter"] = adapter  # not a submodule: its A, B belong to the parent's state
        self.rows, self.adapter_name = rows, adapter_name
        self.in_features, self.out_features = base.in_features, base.out_features

    def delta(self) -> Tensor:
        return self.adapter.delta(self.rows)

    def forward(self, x: Tensor) -> Tensor:
        out = self._base_forward(x)
        return out if self.merged else out + self.adapter.bypass(x, self.rows).to(out.dtype)

    def extra_repr(self) -> str:
        return f"rows {self.rows.start}:{self.rows.stop} of {self.adapter_name}"


LORA_WRAPPERS = (LoRALinear, LoRASlice)
"""The modules that hold a frozen base and run a bypass (the cost model traces them)."""


def _device_of(module: nn.Module) -> torch.device | None:
    return next((p.device for p in module.parameters()), None)


def lora_layers(model: nn.Module) -> dict[str, LoRAAdapter]:
    """Every adapter (what is exchanged as ``<name>.reduce`` / ``<name>.expand``), by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRAAdapter)}


def delta_targets(model: nn.Module) -> dict[str, list[tuple[str, slice]]]:
    """Adapter name -> the base weights its update B A lands in, with the rows of B A each takes.

    ``separate``: ``{"blocks.0.attn.q": [("blocks.0.attn.q.weight", all rows)]}``; ``fused_qkv``:
    ``{"blocks.0.attn.qkv": [("...attn.q.weight", 0:d), ("...attn.k.weight", d:2d), ("...attn.v.weight", 2d:3d)]}``.
    """
    out: dict[str, list[tuple[str, slice]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            out.setdefault(name, []).append((f"{name}.weight", slice(0, module.out_features)))
        elif isinstance(module, LoRASlice):
            out.setdefault(module.adapter_name, []).append((f"{name}.weight", module.rows))
    return out


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every bypass into its base (each refused, by name, if not finite); returns ``model``."""
    for module in model.modules():
        if isinstance(module, _Wrapper):
            module.merge()
    return model


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)


def apply_lora(
    model: nn.Module,
    rank: int,
    scale: float,
    targets: Iterable[str],
    trainable: Iterable[str] = ("head",),
    layout: Layout = "separate",
) -> nn.Module:
    """Freeze ``model`` and put a LoRA bypass on every linear whose last name is in ``targets``.

    ``layout="fused_qkv"``: where a module has linears ``q``, ``k`` and ``v`` on one input (all in
    ``targets``), they share one bypass registered on that module as ``qkv``. Modules named in
    ``trainable`` (by their full name, e.g. the classifier ``head``) stay trainable: a new task
    needs a new head (unless the pre-trained one already fits and is kept frozen). Returns ``model``,
    changed in place.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"adapter_layout: unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
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
    fused: set[str] = set()
    if layout == "fused_qkv":
        if not set(QKV) <= targets:
            raise ValueError(f"adapter_layout fused_qkv needs q, k and v among the targets, got {sorted(targets)}")
        for parent_name, parent in list(model.named_modules()):
            parts = [getattr(parent, p, None) for p in QKV]
            if not all(isinstance(p, nn.Linear) for p in parts):
                continue
            if len({(p.in_features, p.weight.device) for p in parts}) != 1:  # type: ignore[union-attr]
                raise ValueError(f"{parent_name}: q, k and v do not share one input; fused_qkv cannot apply")
            prefix = f"{parent_name}." if parent_name else ""
            outs = [p.out_features for p in parts]  # type: ignore[union-attr]
            adapter = LoRAAdapter(parts[0].in_features, sum(outs), rank, scale, _device_of(parts[0]))  # type: ignore[union-attr]
            parent.qkv = adapter
            start = 0
            for child, base, size in zip(QKV, parts, outs, strict=True):
                rows = slice(start, start + size)
                setattr(parent, child, LoRASlice(base, adapter, rows, f"{prefix}qkv", f"{prefix}{child}"))  # type: ignore[arg-type]
                fused.add(f"{prefix}{child}")
                start += size
        if not fused:
            raise ValueError(f"adapter_layout fused_qkv: {type(model).__name__} has no module with q, k and v linears")
    for name, module in chosen:
        if name not in fused:
            _replace(model, name, LoRALinear(module, rank, scale, name))
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
    "LAYOUTS",
    "LORA_WRAPPERS",
    "MLP_TARGETS",
    "Layout",
    "LoRAAdapter",
    "LoRALinear",
    "LoRASlice",
    "Scale",
    "apply_lora",
    "base_state",
    "delta_targets",
    "exchanged_keys",
    "lora_layers",
    "lora_scale",
    "merge_lora",
    "state_digest",
]
