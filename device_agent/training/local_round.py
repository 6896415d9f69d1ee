"""One round of local work, from a decoded assignment to the tensors that go back.

The agent runtime (over MQTT) and the coordinator's in-process devices both call
:func:`train_assignment`, so an in-process simulation trains exactly what a device trains: the
program of the assignment's spec, federated evaluation of the received model, ``train_local``, the
device's own accuracy measure, the upload packed with its extras.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from device_agent.clients import build_program
from device_agent.clients.base import ClientProgram
from device_agent.clients.spec import ClientSpec, TrainConfig
from device_agent.training.batched import StepRunner, train_stepwise, unbatchable
from device_agent.training.clipping import clip_update
from device_agent.training.federated_evaluation import evaluate_received
from device_agent.training.optimizer import Runner, TrainResult, evaluate_local, run_here, train_local
from device_agent.wire.protocol import ReceivedEvaluation, pack_upload

Split = tuple[Tensor, Tensor]
UNCLIPPED = "dp_unclipped"
"""The extra that carries adaptive clipping's bit: 1 when the update was within the clip norm."""


@dataclass(frozen=True)
class TrainedRound:
    """What one round produced: the packed upload, what the device keeps, and how training went."""

    upload: dict[str, Tensor]
    keep: dict[str, Tensor]
    result: TrainResult
    local_accuracy: float | None
    """The trained model on the device's own test shard (None without one): a personalized model's only measure."""
    received: ReceivedEvaluation | None = None
    """The model as received, before training, on the same test shard: federated evaluation (None without one)."""


def train_assignment(
    spec: ClientSpec,
    train: TrainConfig,
    tensors: Mapping[str, Tensor],
    local: Mapping[str, Tensor] | None,
    shard: Split,
    test: Split,
    device: torch.device | str = "cpu",
    step: Callable[[], AbstractContextManager[object]] | None = None,
    compute: Callable[[], AbstractContextManager[object]] = nullcontext,
    run: Runner = run_here,
    progress: Callable[[int, int], None] | None = None,
    batch: StepRunner | None = None,
) -> TrainedRound:
    """Build the spec's program from the assignment (and what the device kept), evaluate it, train, evaluate, pack.

    ``step`` wraps each training step and ``compute`` each evaluation: devices packed into one worker
    take turns there, so their evaluations do not all hold activations at once. ``run`` runs each step's
    body, each evaluation and the packing inside those (a packed GPU worker runs them on its compute threads);
    ``progress`` hears of each training step (see :func:`train_local`). ``batch``, if given, takes the training
    steps instead of ``step`` and ``run`` where the program can be batched (a worker's step batcher, which runs
    them together with other devices' steps: :mod:`device_agent.training.batched`).
    """
    program = build_program(spec, tensors, local)
    sent = {k: v.detach().clone() for k, v in tensors.items()} if spec.clip is not None else None
    del tensors  # loaded into the program: the caller may hold the only other reference (run_assignment does not)
    with compute():
        received = run(lambda: evaluate_received(program, test, shard[0], device))
    if batch is not None and unbatchable(program, train) is None:
        result = train_stepwise(program, shard, train, device, batch, progress)
    else:
        result = train_local(program, shard, train, device, step=step, run=run, progress=progress)
    with compute():
        local_accuracy = (
            run(lambda: evaluate_local(program, test, device, calibration=shard[0])) if len(test[1]) else None
        )
    with compute():
        upload, keep = run(lambda: (pack_upload(*private_upload(program, spec, sent)), program.keep()))
    program.release({**upload, **keep})
    return TrainedRound(upload, keep, result, local_accuracy, received)


def private_upload(
    program: ClientProgram, spec: ClientSpec, sent: Mapping[str, Tensor] | None
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(upload, extras) of the trained program: clipped to the spec's norm when the fleet runs with privacy."""
    upload, extras = program.upload(), program.extras()
    if spec.clip is None or sent is None:
        return upload, extras
    clipped = clip_update(sent, upload, spec.clip.norm)
    if spec.clip.report_unclipped:
        extras = {**extras, UNCLIPPED: torch.tensor([int(clipped.unclipped)], dtype=torch.int64)}
    return clipped.upload, extras


__all__ = ["UNCLIPPED", "TrainedRound", "private_upload", "train_assignment"]
