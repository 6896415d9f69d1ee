"""Local training for any strategy: the configured optimizer over a client program's model.

Masked cross-entropy: logits of classes absent from the local data are set to -inf before the
softmax, so a client is trained on a softmax over the classes it actually has (HeteroFL/FedHM
masking). -inf rather than the FedHM reference's 0: a 0 logit still takes probability mass and
pushes absent classes' logits around; -inf removes them exactly, and their gradient is 0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from device_agent.clients.base import ClientProgram
from device_agent.clients.spec import TrainConfig
from device_agent.training.sgd import SGD

T = TypeVar("T")


class Runner(Protocol):
    """Where a round's tensor work runs: called with the work, returns its result."""

    def __call__(self, work: Callable[[], T], /) -> T: ...


def run_here(work: Callable[[], T]) -> T:
    """Runs ``work`` on the calling thread: where a round's tensor work runs unless a packed GPU worker moves it."""
    return work()


@dataclass(frozen=True)
class TrainResult:
    samples: int
    steps: int
    seconds: float
    mean_loss: float


def as_tensors(data: Dataset | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """(inputs, labels) of a TensorDataset, an (x, y) pair or any map-style dataset of pairs."""
    if isinstance(data, TensorDataset):
        x, y = data.tensors[0], data.tensors[1]
    elif isinstance(data, tuple):
        x, y = data
    else:
        pairs = [data[i] for i in range(len(data))]  # type: ignore[arg-type]
        x = torch.stack([p[0] for p in pairs])
        y = torch.as_tensor([int(p[1]) for p in pairs])
    if len(x) != len(y):
        raise ValueError(f"{len(x)} inputs but {len(y)} labels")
    if len(y) == 0:
        raise ValueError("no local training data")
    return x, y.long()


def absent_class_mask(labels: Tensor, num_classes: int) -> Tensor:
    """True for every class with no local sample."""
    mask = torch.ones(num_classes, dtype=torch.bool)
    mask[labels.unique()] = False
    return mask


def masked_cross_entropy(logits: Tensor, labels: Tensor, absent: Tensor | None, fill: str = "-inf") -> Tensor:
    """Cross-entropy with the logits of ``absent`` classes replaced by ``fill``.

    "-inf" takes absent classes out of the softmax, so a client holding one class has zero loss and
    learns nothing; "zero" (HeteroFL's and FedHM's reference code) holds them at a constant 0, so that
    client still raises its own class against them (the FedLoRA paper's Dirichlet 0.01 setting needs it).
    """
    if absent is not None and bool(absent.any()):
        value = float("-inf") if fill == "-inf" else 0.0
        logits = logits.masked_fill(absent.to(logits.device), value)
    return F.cross_entropy(logits, labels)


@contextmanager
def scaled_convolutions(model: nn.Module, scale: float) -> Iterator[None]:
    """Multiply every convolution's output by ``scale`` in training mode (HeteroFL's Scaler)."""
    if scale == 1.0:
        yield
        return

    def hook(module: nn.Module, _inputs: object, output: Tensor) -> Tensor | None:
        return output * scale if module.training else None

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def make_optimizer(program: ClientProgram, config: TrainConfig) -> SGD | torch.optim.Adam:
    """The optimizer fleet.yaml asked for, over the program's parameter groups (L2 where the program wants it).

    SGD and momentum are :class:`~device_agent.training.sgd.SGD` (``torch.optim`` imports the compiler stack).
    """
    groups = program.param_groups(config.weight_decay)
    if config.optimizer == "adam":
        return torch.optim.Adam(groups, lr=config.lr)
    return SGD(groups, lr=config.lr, momentum=config.effective_momentum)


def train_local(
    program: ClientProgram,
    data: Dataset | tuple[Tensor, Tensor],
    config: TrainConfig,
    device: torch.device | str = "cpu",
    step: Callable[[], AbstractContextManager[object]] | None = None,
    run: Runner = run_here,
    progress: Callable[[int, int], None] | None = None,
) -> TrainResult:
    """Train ``program.model`` in place for ``config.epochs`` local epochs.

    ``step``, if given, makes a context that wraps every optimizer step (an emulated device's throttle);
    ``run`` runs each step's body inside it (forward, backward, update) and returns the step's loss;
    ``progress`` is told (steps done, steps in all) before the first step and after each.
    """
    x, y = as_tensors(data)
    model = program.model.to(device)
    num_classes = program.spec.model.num_classes
    if int(y.max()) >= num_classes or int(y.min()) < 0:
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{int(y.min())}, {int(y.max())}]")
    program.note_local_classes(y.unique())
    absent = absent_class_mask(y, num_classes) if config.mask_absent_classes else None
    optimizer = make_optimizer(program, config)
    generator = torch.Generator().manual_seed(config.seed)

    def one_step(batch: Tensor) -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        logits = model(x[batch].to(device))
        loss = masked_cross_entropy(logits, y[batch].to(device), absent, config.absent_class_fill)
        extra = program.regularizer()
        total = loss if extra is None else loss + extra
        total.backward()
        program.after_backward()
        optimizer.step()
        return loss.detach()

    steps, loss_sum = 0, 0.0
    total = config.epochs * math.ceil(len(y) / config.batch_size)
    start = time.perf_counter()
    if progress is not None:
        progress(0, total)
    model.train()
    with scaled_convolutions(model, program.train_scale()):
        for _ in range(config.epochs):
            for batch in torch.randperm(len(y), generator=generator).split(config.batch_size):
                with step() if step is not None else nullcontext():
                    loss = run(partial(one_step, batch))
                steps += 1
                loss_sum += float(loss)
                if progress is not None:
                    progress(steps, total)
    return TrainResult(
        samples=len(y), steps=steps, seconds=time.perf_counter() - start, mean_loss=loss_sum / max(steps, 1)
    )


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, x: Tensor, batch_size: int = 256) -> dict[str, Tensor]:
    """Static BN: running statistics recomputed from ``x`` (cumulative average over batches)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return {}
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    model.train()
    for batch in x.split(batch_size):
        model(batch)
    model.eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "running_" in k or "num_batches" in k}


@torch.no_grad()
def evaluate_local(
    program: ClientProgram,
    data: Dataset | tuple[Tensor, Tensor],
    device: torch.device | str = "cpu",
    calibration: Tensor | None = None,
) -> float:
    """Accuracy of the trained ``program.model`` on ``data``, after static BN on ``calibration``.

    On a device this is the only measure of a personalized model: its private part never leaves.
    ``calibration`` (the device's own training inputs) gives BatchNorm exact statistics of the
    trained weights, as the coordinator does for the global model; a few local steps at BN's
    momentum would leave them far from converged.
    """
    x, y = as_tensors(data)
    model = program.model.to(device)
    was_training = model.training
    if calibration is not None:
        calibrate_batchnorm(model, calibration.to(device))
    model.eval()
    try:
        predicted = torch.cat([model(batch.to(device)).argmax(dim=1).cpu() for batch in x.split(512)])
    finally:
        model.train(was_training)
    return float((predicted == y).float().mean())
