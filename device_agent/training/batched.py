"""Many devices' local training steps as one vectorized step: ``torch.func.vmap`` over stacked models.

The devices of one level train the same architecture on the same batch shape, so K of their steps can
run as one: their parameters, buffers and momentum are stacked along a new first axis, one
``vmap(grad_and_value(loss))`` computes every device's loss and gradients (``functional_call`` of one
template module), and the SGD update runs on the stacked tensors. Each device keeps what is its own: its
data order (its generator, :func:`~device_agent.training.optimizer.train_local`'s), its absent-class
mask, its optimizer state and its BatchNorm running statistics (stacked buffers are updated in place per
device by ``batch_norm`` under ``vmap``). The results go back into each device's own model.

A step is the agent's :class:`~device_agent.training.sgd.SGD` step: d = g + wd * p; b = d at the first
step, then b = m * b + d; p -= lr * b. Gradients come from ``torch.func`` rather than ``backward()``, so
gradient-side hooks must be loss terms: a program with :meth:`~device_agent.clients.base.ClientProgram.after_backward`
batches only if it gives the same gradients as :meth:`~device_agent.clients.base.ClientProgram.gradient_penalty`
(FedHM's Frobenius decay). What does not batch (:func:`unbatchable`): Adam, a program with an
``after_backward`` and no penalty, a model with dropout (its mask would be drawn differently), a spec that
cannot key a batch. Those train one by one, as before.

Batched and one-by-one training agree to float rounding (batched matmuls sum in another order), not bit
for bit: ``tests/device_agent/training/test_batched.py`` states the tolerance.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap
from torch.utils.data import Dataset

from device_agent.clients.base import ClientProgram
from device_agent.clients.spec import TrainConfig
from device_agent.training.optimizer import (
    TrainResult,
    absent_class_mask,
    as_tensors,
    make_optimizer,
    masked_cross_entropy,
    scaled_convolutions,
    train_local,
)


def unbatchable(program: ClientProgram, config: TrainConfig) -> str | None:
    """Why ``program`` cannot train in a batched step under ``config``; None when it can."""
    if config.optimizer == "adam":
        return "Adam (batched steps implement the agent's SGD only)"
    kind = type(program)
    if kind.after_backward is not ClientProgram.after_backward and (
        kind.gradient_penalty is ClientProgram.gradient_penalty
    ):
        return f"{kind.__name__} changes gradients after backward() and gives no gradient_penalty"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in program.model.modules()):
        return "the model has dropout (a batched step would draw other masks)"
    try:
        hash(program.spec.model_copy(update={"clip": None}))
    except TypeError:
        return f"its {type(program.spec).__name__} cannot key a batch"
    return None


class _Objective(nn.Module):
    """One device's step loss as a module, so ``functional_call`` swaps the program's tensors everywhere: in the
    forward pass and in the program's loss terms, which read ``program.model`` (its regularizer, its penalty)."""

    def __init__(self, program: ClientProgram, fill: str) -> None:
        super().__init__()
        self.model = program.model
        self.program = [program]  # in a list, so not a submodule
        self.fill = float("-inf") if fill == "-inf" else 0.0

    def forward(self, x: Tensor, y: Tensor, absent: Tensor) -> tuple[Tensor, Tensor]:
        program = self.program[0]
        # Always masked: an all-False mask changes nothing, and vmap cannot branch on a device's mask.
        loss = F.cross_entropy(self.model(x).masked_fill(absent, self.fill), y)
        total = loss
        for extra in (program.regularizer(), program.gradient_penalty()):
            if extra is not None:
                total = total + extra
        return total, loss.detach()


class DeviceTrainer:
    """One device's local training as steps that can be stacked with other devices' (same :attr:`key`).

    Holds what the device's own :func:`~device_agent.training.optimizer.train_local` would: its program, data,
    batches in its generator's order, its momentum buffers. :meth:`result` gives its ``TrainResult``.
    """

    def __init__(
        self,
        program: ClientProgram,
        data: Dataset | tuple[Tensor, Tensor],
        config: TrainConfig,
        device: torch.device | str = "cpu",
    ) -> None:
        reason = unbatchable(program, config)
        if reason is not None:
            raise ValueError(f"cannot batch this device's training: {reason}")
        x, y = as_tensors(data)
        num_classes = program.spec.model.num_classes
        if int(y.max()) >= num_classes or int(y.min()) < 0:
            raise ValueError(f"labels must lie in [0, {num_classes}), got [{int(y.min())}, {int(y.max())}]")
        program.note_local_classes(y.unique())
        self.program, self.config, self.device = program, config, torch.device(device)
        self.model = program.model.to(device)
        self.model.train()
        self.x, self.y = x, y
        absent = absent_class_mask(y, num_classes) if config.mask_absent_classes else None
        self.absent = (absent if absent is not None else torch.zeros(num_classes, dtype=torch.bool)).to(device)
        self.optimizer = make_optimizer(program, config)  # SGD (unbatchable refuses Adam): its buffers are ours
        decay = {id(p): float(g.get("weight_decay", 0.0)) for g in self.optimizer.param_groups for p in g["params"]}
        named = list(self.model.named_parameters())
        self.trained = [(name, p) for name, p in named if id(p) in decay]
        self.frozen = [(name, p) for name, p in named if id(p) not in decay]
        self.buffers = list(self.model.named_buffers())
        self.decay = tuple(decay[id(p)] for _, p in self.trained)
        generator = torch.Generator().manual_seed(config.seed)
        self.batches = [
            batch
            for _ in range(config.epochs)
            for batch in torch.randperm(len(y), generator=generator).split(config.batch_size)
        ]
        spec = program.spec.model_copy(update={"clip": None})
        self._fixed_key = (
            type(program),
            type(self.model),
            spec,
            tuple((n, tuple(p.shape), p.dtype) for n, p in named),
            tuple((n, tuple(b.shape), b.dtype) for n, b in self.buffers),
            config.lr,
            config.effective_momentum,
            self.decay,
            config.absent_class_fill,
            program.train_scale(),
            str(self.device),
        )
        self.losses: list[float] = []

    @property
    def steps(self) -> int:
        return len(self.batches)

    def key(self, step: int) -> Hashable:
        """Devices whose steps share this key run them as one batched step: same model, level, batch shape."""
        return (*self._fixed_key, len(self.batches[step]), tuple(self.x.shape[1:]))

    def result(self, seconds: float) -> TrainResult:
        """What :func:`~device_agent.training.optimizer.train_local` returns, for the steps taken."""
        steps = len(self.losses)
        return TrainResult(
            samples=len(self.y), steps=steps, seconds=seconds, mean_loss=sum(self.losses) / max(steps, 1)
        )


def _stack(tensors: Sequence[Tensor]) -> Tensor:
    return torch.stack([t.detach() for t in tensors])


def batched_step(trainers: Sequence[DeviceTrainer], steps: Sequence[int]) -> list[float]:
    """One SGD step for every trainer (trainer i at its step ``steps[i]``, all of one :meth:`~DeviceTrainer.key`).

    Reads each device's parameters, buffers and momentum, computes the K steps as one, writes them back;
    returns each device's loss. A device may be at another step than the others (its own momentum state says
    whether it has a buffer yet).
    """
    first = trainers[0]
    program, config, device = first.program, first.config, first.device
    names = [n for n, _ in first.trained]
    frozen = {n: _stack([t.frozen[i][1] for t in trainers]) for i, (n, _) in enumerate(first.frozen)}
    buffers = {n: _stack([t.buffers[i][1] for t in trainers]) for i, (n, _) in enumerate(first.buffers)}
    params = {n: _stack([t.trained[i][1] for t in trainers]) for i, n in enumerate(names)}
    x = torch.stack([t.x[t.batches[s]] for t, s in zip(trainers, steps, strict=True)]).to(device)
    y = torch.stack([t.y[t.batches[s]] for t, s in zip(trainers, steps, strict=True)]).to(device)
    absent = torch.stack([t.absent for t in trainers])
    objective = _Objective(program, config.absent_class_fill)

    def loss_of(
        p: dict[str, Tensor], fixed: dict[str, Tensor], b: dict[str, Tensor], xi: Tensor, yi: Tensor, ai: Tensor
    ) -> tuple[Tensor, Tensor]:
        tensors = {f"model.{k}": v for k, v in (*p.items(), *fixed.items(), *b.items())}
        return functional_call(objective, tensors, (xi, yi, ai))

    with scaled_convolutions(first.model, program.train_scale()):
        grads, (_, losses) = vmap(grad_and_value(loss_of, has_aux=True), randomness="error")(
            params, frozen, buffers, x, y, absent
        )
    with torch.no_grad():
        _sgd(trainers, params, grads)
        for k, trainer in enumerate(trainers):
            for i, (_, param) in enumerate(trainer.trained):
                param.copy_(params[names[i]][k])
            for name, buffer in trainer.buffers:
                buffer.copy_(buffers[name][k])
    values = losses.detach().cpu().tolist()
    for trainer, value in zip(trainers, values, strict=True):
        trainer.losses.append(value)
    return values


def _sgd(trainers: Sequence[DeviceTrainer], params: dict[str, Tensor], grads: dict[str, Tensor]) -> None:
    """The agent's SGD step on stacked tensors, each device with its own momentum buffers (its optimizer's)."""
    first = trainers[0]
    lr, momentum = first.config.lr, first.config.effective_momentum
    for index, name in enumerate(params):
        p, g = params[name], grads[name]
        decay = first.decay[index]
        d = g if decay == 0 else g.add(p, alpha=decay)
        if momentum != 0:
            owners = [t.trained[index][1] for t in trainers]
            held = [t.optimizer.buffers.get(o) for t, o in zip(trainers, owners, strict=True)]
            # A device without a buffer yet (its first step) gets b = 0 * 0 + d = d exactly, as SGD's clone(d).
            carry = torch.tensor([0.0 if h is None else momentum for h in held], device=p.device)
            b = torch.stack([torch.zeros_like(p[0]) if h is None else h for h in held])
            b.mul_(carry.view(-1, *[1] * (b.dim() - 1))).add_(d)
            for k, (trainer, owner) in enumerate(zip(trainers, owners, strict=True)):
                trainer.optimizer.buffers[owner] = b[k]
            d = b
        p.add_(d, alpha=-lr)


def single_step(trainer: DeviceTrainer, step: int) -> float:
    """One device's step alone, on its own module, exactly as :func:`~device_agent.training.optimizer.train_local`
    takes it (``backward()`` and the program's hooks): cheaper than a batched step of one."""
    program, config, model, optimizer = trainer.program, trainer.config, trainer.model, trainer.optimizer
    batch = trainer.batches[step]
    optimizer.zero_grad(set_to_none=True)
    with scaled_convolutions(model, program.train_scale()):
        logits = model(trainer.x[batch].to(trainer.device))
    absent = trainer.absent if config.mask_absent_classes else None
    loss = masked_cross_entropy(logits, trainer.y[batch].to(trainer.device), absent, config.absent_class_fill)
    extra = program.regularizer()
    (loss if extra is None else loss + extra).backward()
    program.after_backward()
    optimizer.step()
    value = float(loss.detach())
    trainer.losses.append(value)
    return value


class StepRunner(Protocol):
    """Takes one step of a device's :class:`DeviceTrainer` (alone or batched with other devices'); its loss."""

    def __call__(self, trainer: DeviceTrainer, step: int, /) -> float: ...


def train_stepwise(
    program: ClientProgram,
    data: Dataset | tuple[Tensor, Tensor],
    config: TrainConfig,
    device: torch.device | str,
    runner: StepRunner,
    progress: Callable[[int, int], None] | None = None,
) -> TrainResult:
    """:func:`~device_agent.training.optimizer.train_local` with every step handed to ``runner`` (a worker's
    batcher, which may run it together with other devices' steps); ``program`` must be batchable."""
    trainer = DeviceTrainer(program, data, config, device)
    start = time.perf_counter()
    if progress is not None:
        progress(0, trainer.steps)
    for step in range(trainer.steps):
        runner(trainer, step)
        if progress is not None:
            progress(step + 1, trainer.steps)
    return trainer.result(time.perf_counter() - start)


def train_batched(
    programs: Sequence[ClientProgram],
    data: Sequence[Dataset | tuple[Tensor, Tensor]],
    configs: Sequence[TrainConfig],
    device: torch.device | str = "cpu",
    max_batch: int = 256,
) -> list[TrainResult]:
    """Train each program in place as :func:`~device_agent.training.optimizer.train_local` would, batching the
    steps of devices that share a key (up to ``max_batch`` at once); the rest train one by one."""
    results: list[TrainResult | None] = [None] * len(programs)
    trainers: dict[int, DeviceTrainer] = {}
    for i, (program, config) in enumerate(zip(programs, configs, strict=True)):
        if unbatchable(program, config) is None:
            trainers[i] = DeviceTrainer(program, data[i], config, device)
        else:
            results[i] = train_local(program, data[i], config, device)
    start = time.perf_counter()
    done = dict.fromkeys(trainers, 0)
    while any(done[i] < trainers[i].steps for i in done):
        groups: dict[Hashable, list[int]] = {}
        for i, n in done.items():
            if n < trainers[i].steps:
                groups.setdefault(trainers[i].key(n), []).append(i)
        for members in groups.values():
            for chunk in range(0, len(members), max_batch):
                part = members[chunk : chunk + max_batch]
                batched_step([trainers[i] for i in part], [done[i] for i in part])
                for i in part:
                    done[i] += 1
    seconds = time.perf_counter() - start
    for i, trainer in trainers.items():
        results[i] = trainer.result(seconds)
    return [r for r in results if r is not None]
