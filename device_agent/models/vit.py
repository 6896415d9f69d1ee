"""A small Vision Transformer (patch embedding, class token, pre-norm blocks) for FedLoRA.

Module names follow timm's ``VisionTransformer`` so pre-trained checkpoints map almost one to
one; the one difference is that attention has separate ``q``, ``k``, ``v`` projections (timm
fuses them into ``qkv``), because FedLoRA puts one low-rank bypass on each of W^Q, W^K, W^V and
W^O (FedHM paper Eq. 9-10). :func:`convert_checkpoint` does the mapping.

Checkpoint key mapping (a ViT-S/16 a user downloads; ``vit_small`` has the same shapes):

======================================================  ==========================================
timm (``vit_small_patch16_224``)                        fedfleet
======================================================  ==========================================
``cls_token``, ``pos_embed``                            same
``patch_embed.proj.{weight,bias}``                      same
``blocks.{i}.norm1`` / ``norm2`` / ``mlp.fc1`` / ``fc2``  same
``blocks.{i}.attn.qkv.{weight,bias}`` (3d rows)         ``blocks.{i}.attn.{q,k,v}.*`` (split in 3)
``blocks.{i}.attn.proj.*``, ``norm.*``, ``head.*``      same
HF (``google/vit-*`` / ``WinKawaks/vit-small-*``)
``vit.embeddings.cls_token`` / ``position_embeddings``  ``cls_token`` / ``pos_embed``
``vit.embeddings.patch_embeddings.projection.*``        ``patch_embed.proj.*``
``vit.encoder.layer.{i}.layernorm_before`` / ``_after``  ``blocks.{i}.norm1`` / ``norm2``
``...attention.attention.{query,key,value}.*``          ``blocks.{i}.attn.{q,k,v}.*``
``...attention.output.dense.*``                         ``blocks.{i}.attn.proj.*``
``...intermediate.dense.*`` / ``...output.dense.*``     ``blocks.{i}.mlp.fc1.*`` / ``fc2.*``
``vit.layernorm.*``, ``classifier.*``                   ``norm.*``, ``head.*``
======================================================  ==========================================

A head for a different number of classes is not loaded (``convert_checkpoint(..., drop_head=True)``):
fine-tuning starts it from zero.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn


@dataclass(frozen=True)
class ViTConfig:
    image_size: int
    patch_size: int
    dim: int
    depth: int
    heads: int
    mlp_ratio: int = 4


VIT_CONFIGS = {
    "vit_tiny": ViTConfig(image_size=8, patch_size=2, dim=64, depth=4, heads=4),
    "vit_fmnist": ViTConfig(image_size=28, patch_size=7, dim=128, depth=6, heads=4),
    "vit_small": ViTConfig(image_size=224, patch_size=16, dim=384, depth=12, heads=6),
}
"""vit_tiny: 8x8 inputs (digits) on CPU; vit_fmnist: 28x28 inputs (Fashion-MNIST), 1.2 M parameters, a
base that can be pre-trained on CPU and still transfers; vit_small: the paper's ViT-Small (ViT-S/16, 22 M)."""


class Attention(nn.Module):
    """Multi-head self-attention with separate Q, K, V projections and output projection ``proj``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape

        def split(t: Tensor) -> Tensor:
            return t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + MSA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), MLP(dim, dim * mlp_ratio)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, dim: int, patch_size: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(nn.Module):
    """ViT with a class token and learned position embeddings; the head reads the class token."""

    def __init__(self, config: ViTConfig, num_classes: int, in_channels: int) -> None:
        super().__init__()
        if config.image_size % config.patch_size:
            raise ValueError(f"image size {config.image_size} is not a multiple of patch size {config.patch_size}")
        self.config = config
        tokens = (config.image_size // config.patch_size) ** 2 + 1
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.dim))
        self.pos_embed = nn.Parameter(torch.empty(1, tokens, config.dim))
        self.patch_embed = PatchEmbed(in_channels, config.dim, config.patch_size)
        self.blocks = nn.Sequential(*(Block(config.dim, config.heads, config.mlp_ratio) for _ in range(config.depth)))
        self.norm = nn.LayerNorm(config.dim, eps=1e-6)
        self.head = nn.Linear(config.dim, num_classes)
        if self.pos_embed.device.type != "meta":
            nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def features(self, x: Tensor) -> Tensor:
        """The normalized class token the head reads (what a linear probe is trained on)."""
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.norm(self.blocks(x))[:, 0]

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def _builder(arch: str) -> Callable[..., VisionTransformer]:
    def build(num_classes: int = 10, in_channels: int = 3, width: float = 1.0) -> VisionTransformer:
        if width != 1:
            raise ValueError(f"{arch} has no width levels (got width {width}); FedLoRA sizes devices by LoRA rank")
        return VisionTransformer(VIT_CONFIGS[arch], num_classes, in_channels)

    return build


vit_tiny = _builder("vit_tiny")
vit_fmnist = _builder("vit_fmnist")
vit_small = _builder("vit_small")

_TIMM_QKV = re.compile(r"^blocks\.(\d+)\.attn\.qkv\.(weight|bias)$")
_HF_RULES: tuple[tuple[str, str], ...] = (
    (r"^vit\.embeddings\.cls_token$", "cls_token"),
    (r"^vit\.embeddings\.position_embeddings$", "pos_embed"),
    (r"^vit\.embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^vit\.encoder\.layer\.(\d+)\.layernorm_before\.", r"blocks.\1.norm1."),
    (r"^vit\.encoder\.layer\.(\d+)\.layernorm_after\.", r"blocks.\1.norm2."),
    (r"^vit\.encoder\.layer\.(\d+)\.attention\.attention\.query\.", r"blocks.\1.attn.q."),
    (r"^vit\.encoder\.layer\.(\d+)\.attention\.attention\.key\.", r"blocks.\1.attn.k."),
    (r"^vit\.encoder\.layer\.(\d+)\.attention\.attention\.value\.", r"blocks.\1.attn.v."),
    (r"^vit\.encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"blocks.\1.attn.proj."),
    (r"^vit\.encoder\.layer\.(\d+)\.intermediate\.dense\.", r"blocks.\1.mlp.fc1."),
    (r"^vit\.encoder\.layer\.(\d+)\.output\.dense\.", r"blocks.\1.mlp.fc2."),
    (r"^vit\.layernorm\.", "norm."),
    (r"^classifier\.", "head."),
)


def convert_checkpoint(state: Mapping[str, Tensor], drop_head: bool = False) -> dict[str, Tensor]:
    """A timm / HF ViT state dict (or one of ours) in fedfleet's key layout (see the module docstring)."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if fused := _TIMM_QKV.match(key):
            block, kind = fused.groups()
            for name, part in zip("qkv", value.chunk(3, dim=0), strict=True):
                out[f"blocks.{block}.attn.{name}.{kind}"] = part.contiguous()
            continue
        for pattern, replacement in _HF_RULES:
            if re.match(pattern, key):
                key = re.sub(pattern, replacement, key)
                break
        out[key] = value
    if drop_head:
        out = {k: v for k, v in out.items() if not k.startswith("head.")}
    return out


def load_checkpoint(path: Path | str, drop_head: bool = False) -> dict[str, Tensor]:
    """A ViT checkpoint from a safetensors file, converted to fedfleet's keys."""
    return convert_checkpoint(load_file(str(path)), drop_head=drop_head)
