"""Which torch model an export writes: the merged global model, a FedHM hybrid of one rank ratio, or
one device's personalized model.

Export never imports the coordinator: the coordinator reads its run directory and strategy and
hands over a :class:`TrainedRun`; the models themselves are built here from device_agent code, the
same code a device trains with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from device_agent.agent.kept import SUFFIX as KEPT_SUFFIX
from device_agent.clients import build_program
from device_agent.clients.base import KeptStateMissing
from device_agent.clients.spec import ClientSpec
from device_agent.data.datasets import FASHION_MNIST, load_dataset, source_of
from device_agent.layers import dense_state, rank_one_layers
from device_agent.layers.factorized import LowRankLayer
from device_agent.layers.hybrid import hybrid
from device_agent.models import build_model

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
# Where `coordinator emulate` keeps each agent's state (kept tensors of personalized strategies).
AGENT_KEPT_DIR = "agents/{device}/state/kept"


class ExportError(ValueError):
    """An export that cannot be made as asked; the message says what to change."""


@dataclass(frozen=True)
class TrainedRun:
    """A run as export needs it; built by the coordinator from its run directory and strategy."""

    path: Path
    run_id: str
    round: int
    strategy: str
    personalized: bool
    rank_levels: bool
    """True when the strategy's levels are FedHM rank ratios (a hybrid model exists per ratio)."""
    ratios: tuple[float, ...]
    arch: str
    num_classes: int
    in_channels: int
    image_size: int
    dataset: str
    dataset_path: Path | None
    global_model: Callable[[], nn.Module]
    """The dense global model of ``round`` (full rank)."""
    personal_devices: tuple[str, ...]
    """Devices the server keeps a personalized model (part) for."""
    assignment: Callable[[str], tuple[ClientSpec, dict[str, Tensor]]]
    """What the strategy would send ``device`` next: its client spec and personalized tensors."""


@dataclass
class Target:
    """``reference`` is the model as trained (parity is measured against it); ``model`` is what is exported."""

    kind: str
    reference: nn.Module
    model: nn.Module
    ratio: float | None = None
    device: str | None = None

    @property
    def label(self) -> str:
        return target_label(self.kind, self.ratio, self.device)


def target_label(kind: str, ratio: float | None = None, device: str | None = None) -> str:
    """'merged', 'ratio:1/4' or 'personal:<device>': how records, reports and file names call a target."""
    if kind == "personal":
        return f"personal:{device}"
    return "merged" if kind == "merged" else f"ratio:{ratio_text(ratio or 1.0)}"


def ratio_text(ratio: float) -> str:
    return str(Fraction(ratio).limit_denominator(1000))


def parse_ratio(text: str | float) -> float:
    """'1/4', '0.25' or 0.25 -> 0.25, in (0, 1]."""
    try:
        value = float(Fraction(str(text).strip()))
    except (ValueError, ZeroDivisionError):
        raise ExportError(f"{text!r} is not a rank ratio (use e.g. 0.25 or 1/4)") from None
    if not 0 < value <= 1:
        raise ExportError(f"rank ratio {text} is outside (0, 1]")
    return value


@torch.no_grad()
def hybrid_from_dense(
    arch: str, gamma: float, state: dict[str, Tensor], num_classes: int, in_channels: int
) -> nn.Module:
    """The FedHM hybrid at ``gamma`` from full-rank weights: each factorized layer gets the truncated SVD
    of its weight (what a device of that ratio receives), every other tensor is copied."""
    model = hybrid(arch, gamma, num_classes, in_channels)
    for name, module in model.named_modules():
        if isinstance(module, LowRankLayer):
            module.load_dense_(state[f"{name}.weight"])
    model.load_state_dict({k: state.get(k, v) for k, v in model.state_dict().items()})
    return model.eval()


def _dense_copy(run: TrainedRun, model: nn.Module) -> nn.Module:
    """A rank-one-plus-sparse model as the plain model with its composed weights: one Conv per layer."""
    if not rank_one_layers(model):
        return model
    dense = build_model(run.arch, run.num_classes, run.in_channels)
    dense.load_state_dict(dense_state(model.eval()))
    return dense.eval()


def _kept_state(run: TrainedRun, device: str, device_state: Path | None) -> dict[str, Tensor] | None:
    path = device_state
    if path is None:
        candidate = run.path / AGENT_KEPT_DIR.format(device=device) / f"{run.run_id}{KEPT_SUFFIX}"
        path = candidate if candidate.is_file() else None
    if path is None:
        return None
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise ExportError(f"{path}: not a readable safetensors file of kept state ({error})") from None


def build_target(
    run: TrainedRun,
    *,
    ratio: float | None = None,
    merged: bool = False,
    personal: str | None = None,
    device_state: Path | None = None,
) -> Target:
    """The model to export; every impossible request is an :class:`ExportError` naming what to change."""
    if sum([ratio is not None, merged, personal is not None]) != 1:
        raise ExportError("choose exactly one of --ratio G, --merged or --personal DEVICE")
    if personal is not None:
        return _personal(run, personal, device_state)
    global_model = run.global_model().eval()
    if merged or ratio == 1.0:
        return Target("merged", global_model, global_model, 1.0)
    assert ratio is not None
    if not run.rank_levels:
        raise ExportError(
            f"--ratio needs a strategy whose levels are rank ratios (fedhm); run {run.run_id} used {run.strategy!r}: "
            "export it with --merged" + (" or --personal DEVICE" if run.personalized else "")
        )
    if not any(abs(ratio - r) < 1e-9 for r in run.ratios):
        levels = ", ".join(ratio_text(r) for r in run.ratios)
        raise ExportError(f"--ratio {ratio_text(ratio)} is not one of the run's rank ratios ({levels})")
    state = global_model.state_dict()
    model = hybrid_from_dense(run.arch, ratio, state, run.num_classes, run.in_channels)
    return Target("ratio", model, model, ratio)


def _personal(run: TrainedRun, device: str, device_state: Path | None) -> Target:
    if not run.personalized:
        raise ExportError(
            f"--personal needs a personalized strategy (factorized_fl, factorized_fl_beta, simfed, fedfac); "
            f"run {run.run_id} used {run.strategy!r}, whose devices all share the global model: use --merged"
        )
    if device not in run.personal_devices:
        known = ", ".join(sorted(run.personal_devices)) or "none yet"
        raise ExportError(
            f"device {device!r} has no personalized model in round {run.round} (devices with one: {known})"
        )
    spec, tensors = run.assignment(device)
    local = _kept_state(run, device, device_state)
    try:
        program = build_program(spec, tensors, local)
    except KeptStateMissing:
        raise ExportError(
            f"{run.strategy}: part of {device!r}'s model (v, mu, biases, BatchNorm, classifier) never leaves the "
            f"device; pass --device-state FILE with its kept state (agent state_dir/kept/{run.run_id}{KEPT_SUFFIX})"
        ) from None
    except ValueError as error:
        raise ExportError(f"{device!r}: {error}") from None
    reference = program.model.eval()
    return Target("personal", reference, _dense_copy(run, reference), 1.0, device)


def class_names(dataset: str, path: Path | None, num_classes: int) -> list[str]:
    """Human names of the classes where the data set has them, else the label numbers."""
    names: Sequence[str] | None = None
    if dataset == "digits":
        names = [str(i) for i in range(10)]
    elif dataset == "cifar10":
        names = CIFAR10_CLASSES
    elif dataset == FASHION_MNIST:
        names = FASHION_MNIST_CLASSES
    elif dataset == "image_folder" and path is not None and path.is_dir():
        root = path / "train" if (path / "train").is_dir() and (path / "test").is_dir() else path
        names = sorted(d.name for d in root.iterdir() if d.is_dir())
    if names is None or len(names) != num_classes:
        names = [str(i) for i in range(num_classes)]
    return list(names)


def load_run_data(run: TrainedRun):
    """The run's data set, fitted to the model as the coordinator loads it (test split used here)."""
    return load_dataset(source_of(run.dataset, run.dataset_path), run.image_size, run.in_channels)
