"""Pre-train a model centrally and save it as a base checkpoint for federated fine-tuning.

Nothing can be downloaded here, so the FedLoRA example, benchmark and tests make their own
"pre-trained" ViT: trained on one task (digits 0-4), then fine-tuned federatedly on another. With a
real checkpoint (timm/HF ViT-S/16 safetensors) this step is skipped: fleet.yaml's strategy params
point ``base_checkpoint`` at the downloaded file.

    coordinator pretrain --arch vit_tiny --dataset digits --classes 0-4 --out runs/vit_tiny-digits-0-4.safetensors
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from device_agent.data.datasets import DatasetError, LabeledData, load_dataset
from device_agent.models import MODELS, build_model


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


def class_subset(data: LabeledData, classes: Iterable[int]) -> LabeledData:
    """The samples of ``classes`` only (labels unchanged, so pre-training and fine-tuning share one head)."""
    keep = torch.tensor(list(classes))
    train, test = torch.isin(data.train_y, keep), torch.isin(data.test_y, keep)
    return LabeledData(data.train_x[train], data.train_y[train], data.test_x[test], data.test_y[test], data.num_classes)


def _classes(text: str) -> list[int]:
    """'0-4' or '0,2,5' -> class indices."""
    try:
        if "-" in text:
            first, last = (int(part) for part in text.split("-", 1))
            classes = list(range(first, last + 1))
        else:
            classes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write a range like 0-4 or a list like 0,2,5") from None
    if not classes or min(classes) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: no classes, or a negative one")
    return classes


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "pretrain",
        help="pre-train a model centrally and write a base checkpoint for fedlora / ft",
        description=(
            "Train ARCH with Adam on the chosen classes of a dataset and write its state dict as a "
            "safetensors file, for a fine-tuning strategy's base_checkpoint. For when no pre-trained "
            "checkpoint can be downloaded (a timm/HF ViT-S/16 file works as it is)."
        ),
        epilog="example: coordinator pretrain --arch vit_tiny --classes 0-4 --out runs/vit_tiny-digits-0-4.safetensors",
    )
    parser.add_argument("--arch", choices=sorted(MODELS), default="vit_tiny", help="model (default: vit_tiny)")
    parser.add_argument("--dataset", default="digits", help="'digits' or a dataset path, as in fleet.yaml")
    parser.add_argument("--classes", type=_classes, help="train on these classes only, e.g. 0-4 (default: all)")
    parser.add_argument("--epochs", type=int, default=30, help="passes over the data (default: 30)")
    parser.add_argument("--seed", type=int, default=0, help="initialization and shuffling seed (default: 0)")
    parser.add_argument("--out", type=Path, required=True, help="the safetensors file to write")
    parser.set_defaults(handler=_pretrain)


def _pretrain(args: argparse.Namespace) -> int:
    try:
        data = load_dataset(args.dataset)
    except DatasetError as exc:
        print(f"coordinator pretrain: error: {exc}", file=sys.stderr)
        return 2
    if args.classes is not None:
        unknown = [c for c in args.classes if c >= data.num_classes]
        if unknown:
            print(f"coordinator pretrain: error: classes {unknown} not in 0-{data.num_classes - 1}", file=sys.stderr)
            return 2
        data = class_subset(data, args.classes)
    state = pretrain(args.arch, data.train_x, data.train_y, data.num_classes, args.epochs, args.seed)
    model = build_model(args.arch, data.num_classes, data.in_channels)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        accuracy = (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
    print(f"{save_checkpoint(state, args.out)}: {args.arch}, {len(data.train_y)} samples, test accuracy {accuracy:.3f}")
    return 0
