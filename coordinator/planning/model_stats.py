"""What a hybrid model costs a device: trainable parameters, upload bytes, forward MACs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from device_agent.layers.hybrid import hybrid
from device_agent.models import model_card


@dataclass(frozen=True)
class ModelStats:
    ratio: float
    params: int
    upload_bytes: int
    macs: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def model_stats(
    arch: str,
    ratio: float,
    num_classes: int = 10,
    in_channels: int | None = None,
    image_size: int | None = None,
) -> ModelStats:
    """Costs of ``hybrid(arch, ratio)``, measured on the meta device (no memory, no compute).

    upload_bytes is what a FedHM client sends back: every trainable tensor (factors, full-rank
    layers, norm affine parameters) in fp32; BatchNorm running statistics stay on the device.
    macs counts one forward pass of one sample through convolutions and linear layers (the
    usual convention; norms, activations and pooling are excluded).
    """
    card = model_card(arch)
    channels = in_channels or card.in_channels
    size = image_size or card.image_size
    with torch.device("meta"):
        model = hybrid(arch, ratio, num_classes, channels)
        sample = torch.empty(1, channels, size, size)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    upload = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    counter = FlopCounterMode(display=False)
    with counter:
        model(sample)
    return ModelStats(ratio=ratio, params=params, upload_bytes=upload, macs=counter.get_total_flops() // 2)
