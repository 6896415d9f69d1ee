"""The model zoo: every architecture a fleet can train, with its FedHM full-rank set.

``full_rank`` lists fnmatch patterns of module names that stay dense in a hybrid model; every
other Conv2d / Linear is factorized when gamma < 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from device_agent.models.cnn import small_cnn, small_cnn28
from device_agent.models.resnet import resnet18, resnet34
from device_agent.models.resnet9 import resnet9
from device_agent.models.vit import vit_fmnist, vit_small, vit_tiny
from device_agent.models.width import scaled_channels


@dataclass(frozen=True)
class ModelCard:
    name: str
    builder: Callable[..., nn.Module]
    full_rank: tuple[str, ...]
    in_channels: int
    image_size: int
    summary: str
    fixed_size: bool = False
    """The model takes ``image_size`` inputs only (a ViT's position embeddings): data is resized to it."""


MODELS: dict[str, ModelCard] = {
    card.name: card
    for card in (
        ModelCard(
            "resnet18",
            resnet18,
            ("conv1", "layer1.0.*", "*.downsample.*", "fc"),
            3,
            32,
            "CIFAR ResNet-18 (FedHM Table B.8): stem, layer1 block 0, downsamples, classifier full rank",
        ),
        ModelCard(
            "resnet34",
            resnet34,
            ("conv1", "layer1.*", "layer2.*", "*.downsample.*", "fc"),
            3,
            32,
            "CIFAR ResNet-34 (FedHM Table B.9): stem, layer1-2, downsamples, classifier full rank",
        ),
        ModelCard(
            "resnet9",
            resnet9,
            ("conv1.conv", "fc"),
            3,
            32,
            "Factorized-FL ResNet-9 (seed 000 Table 3): first conv and classifier full rank",
        ),
        ModelCard(
            "cnn",
            small_cnn,
            ("conv1", "fc"),
            1,
            8,
            "Small 3-conv CNN for 8x8-32x32 inputs on CPU: first conv and classifier full rank",
        ),
        ModelCard(
            "cnn28",
            small_cnn28,
            ("conv1", "fc"),
            1,
            28,
            "The small CNN pooled after its first conv too, for 28x28 (Fashion-MNIST): 2.8x faster on CPU",
        ),
        ModelCard(
            "vit_tiny",
            vit_tiny,
            ("patch_embed.*", "head"),
            1,
            8,
            "Tiny ViT (patch 2, dim 64, depth 4, 4 heads) for 8x8 digits: FedLoRA on CPU",
            fixed_size=True,
        ),
        ModelCard(
            "vit_fmnist",
            vit_fmnist,
            ("patch_embed.*", "head"),
            1,
            28,
            "ViT (patch 7, dim 128, depth 6, 4 heads, 1.2 M) for 28x28 Fashion-MNIST: a FedLoRA base for CPU",
            fixed_size=True,
        ),
        ModelCard(
            "vit_small",
            vit_small,
            ("patch_embed.*", "head"),
            3,
            224,
            "ViT-S/16 (dim 384, depth 12, 6 heads): FedLoRA's pre-trained model (timm/HF checkpoints)",
            fixed_size=True,
        ),
    )
}


def model_card(name: str) -> ModelCard:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))}") from None


def build_model(name: str, num_classes: int = 10, in_channels: int | None = None, width: float = 1.0) -> nn.Module:
    """The plain (gamma = 1) model; ``in_channels`` defaults to the model card's.

    ``width`` in (0, 1] scales every hidden layer to ceil(C * width) channels (HeteroFL/FedRolex
    sub-models); input channels and classifier outputs never change, nor do module names.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if not 0 < width <= 1:
        raise ValueError(f"width must be in (0, 1], got {width}")
    card = model_card(name)
    return card.builder(num_classes=num_classes, in_channels=in_channels or card.in_channels, width=width)


__all__ = ["MODELS", "ModelCard", "build_model", "model_card", "scaled_channels"]
