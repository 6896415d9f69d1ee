"""A worker's devices training at once: their queued steps run as batched steps, each device gets its own result."""

from __future__ import annotations

import threading
import time

import torch

from device_agent.clients import build_program
from device_agent.clients.registry import PROGRAMS
from device_agent.clients.spec import ModelSpec, TrainConfig, WidthSpec
from device_agent.emulation.batching import StepBatcher
from device_agent.emulation.slots import ComputeSlots
from device_agent.training.batched import DeviceTrainer, train_stepwise
from device_agent.training.optimizer import train_local

SPEC = WidthSpec(strategy="heterofl", model=ModelSpec("cnn", 10, 1, 8), level=0.25, scaler=True, send_classes=False)
TRAIN = TrainConfig(epochs=2, batch_size=8)
K = 6


def device_data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(k)
    return torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def wait_until_queued(batcher: StepBatcher, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while batcher.queued < n:
        assert time.monotonic() < deadline, f"{batcher.queued} of {n} steps queued"
        time.sleep(0.01)


def test_devices_waiting_for_the_slot_train_as_one_batched_step_and_each_ends_with_its_own_model() -> None:
    torch.manual_seed(0)
    tensors = PROGRAMS.get("heterofl").build_model(SPEC).state_dict()
    alone = [build_program(SPEC, tensors) for _ in range(K)]
    together = [build_program(SPEC, tensors) for _ in range(K)]
    configs = [TRAIN.model_copy(update={"seed": k}) for k in range(K)]
    for k, program in enumerate(alone):
        train_local(program, device_data(k), configs[k])

    slots = ComputeSlots(1)
    batcher = StepBatcher(slots, max_batch=K)

    def runner(trainer: DeviceTrainer, step: int) -> float:
        return batcher.step(trainer, step, priority=0.0)

    slots.acquire(0.0)  # busy: every device's first step queues behind it
    errors: list[BaseException] = []

    def train(k: int) -> None:
        try:
            train_stepwise(together[k], device_data(k), configs[k], "cpu", runner)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(k,)) for k in range(K)]
    for thread in threads:
        thread.start()
    wait_until_queued(batcher, K)
    slots.release()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert batcher.batched_steps >= K, "the queued first steps did not run as one batched step"
    assert batcher.batched_steps + batcher.single_steps == K * 4
    for k in range(K):
        for name, value in alone[k].model.state_dict().items():
            torch.testing.assert_close(together[k].model.state_dict()[name], value, atol=1e-5, rtol=1e-4)


def test_a_failed_batched_step_fails_every_device_it_held() -> None:
    """One device's bad step fails the batched step: every device in it gets the error, none waits forever."""
    torch.manual_seed(0)
    tensors = PROGRAMS.get("heterofl").build_model(SPEC).state_dict()
    trainers = [DeviceTrainer(build_program(SPEC, tensors), device_data(k), TRAIN) for k in range(2)]
    trainers[1].y = trainers[1].y + 100  # labels past the classifier's 10 classes
    slots = ComputeSlots(1)
    batcher = StepBatcher(slots)
    raised: list[BaseException] = []

    def step(trainer: DeviceTrainer) -> None:
        try:
            batcher.step(trainer, 0, priority=0.0)
        except Exception as exc:
            raised.append(exc)

    slots.acquire(0.0)
    threads = [threading.Thread(target=step, args=(t,)) for t in trainers]
    for thread in threads:
        thread.start()
    wait_until_queued(batcher, 2)
    slots.release()
    for thread in threads:
        thread.join(60)
    assert len(raised) == 2 and raised[0] is raised[1]
    assert batcher.batched_steps == batcher.single_steps == 0
