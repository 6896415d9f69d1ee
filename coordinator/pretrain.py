"""Pre-train a model centrally and save it as a base checkpoint for federated fine-tuning.

Nothing can be downloaded here, so the FedLoRA demo, benchmark and tests make their own
"pre-trained" ViT: trained on one task (digits 0-4), then fine-tuned federatedly on another. With a
real checkpoint (timm/HF ViT-S/16 safetensors) this step is skipped: fleet.yaml's strategy params
point ``base_checkpoint`` at the downloaded file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from device_agent.models import build_model


def pretrain(
    arch: str, x: Tensor, y: Tensor, num_classes: int, epochs: int = 30, seed: int = 0, lr: float = 2e-3
) -> dict[str, Tensor]:
    """The state dict of ``arch`` trained with Adam on (x, y); deterministic for a seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(arch, num_classes, int(x.shape[1]))
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        model.train()
        for _ in range(epochs):
            for batch in torch.randperm(len(y)).split(64):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                optimizer.step()
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def save_checkpoint(state: dict[str, Tensor], path: Path | str) -> Path:
    """Write a base checkpoint (safetensors) that ``base_checkpoint`` can point at."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path
