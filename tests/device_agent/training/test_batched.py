"""K devices trained in batched steps end where K devices trained one by one do, within float rounding.

Each device has its own starting weights, data, seed (so its own data order) and absent classes; a batched
step stacks them and computes every device's step at once (:mod:`device_agent.training.batched`). The
tolerance: after 2 epochs of momentum SGD, every parameter and BatchNorm statistic within ``ATOL`` + ``RTOL``
x its magnitude of the one-by-one result (float32; batched matmuls and convolutions sum in another order).
"""

from __future__ import annotations

import pytest
import torch

from device_agent.clients import build_program
from device_agent.clients.base import ClientProgram
from device_agent.clients.lora import LoRAProgram
from device_agent.clients.registry import PROGRAMS
from device_agent.clients.spec import FedHMSpec, LoRASpec, ModelSpec, SpecBase, TrainConfig, WidthSpec
from device_agent.layers.lora import base_state, state_digest
from device_agent.training.batched import (
    DeviceTrainer,
    batched_step,
    single_step,
    train_batched,
    train_stepwise,
    unbatchable,
)
from device_agent.training.optimizer import train_local

ATOL, RTOL = 1e-5, 1e-4
K = 4
CNN = ModelSpec("cnn", 10, 1, 8)
TRAIN = TrainConfig(lr=0.05, momentum=0.9, weight_decay=5e-4, epochs=2, batch_size=8)


def shard(k: int, spec: SpecBase, n: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Device k's data: 20 samples (batches of 8, 8 and 4), of classes k .. k + 5 (the rest absent)."""
    gen = torch.Generator().manual_seed(100 + k)
    size, channels = spec.model.image_size, spec.model.in_channels
    return torch.randn(n, channels, size, size, generator=gen), k + torch.randint(0, 6, (n,), generator=gen)


def programs(
    spec: SpecBase, tensors: dict[str, torch.Tensor], k: int, fixed: frozenset[str] = frozenset()
) -> tuple[ClientProgram, ClientProgram]:
    """Two identical programs for device k (one per path), its weights the assignment's nudged by its own noise
    (all but the ``fixed`` tensors and BatchNorm statistics)."""
    gen = torch.Generator().manual_seed(k)
    own = {
        name: t + 0.01 * torch.randn(t.shape, generator=gen)
        if t.is_floating_point() and "running" not in name and name not in fixed
        else t
        for name, t in tensors.items()
    }
    return build_program(spec, own), build_program(spec, own)


def assert_same_training(spec: SpecBase, tensors: dict[str, torch.Tensor], fixed: frozenset[str] = frozenset()) -> None:
    pairs = [programs(spec, tensors, k, fixed) for k in range(K)]
    data = [shard(k, spec) for k in range(K)]
    configs = [TRAIN.model_copy(update={"seed": 7 + k}) for k in range(K)]
    alone = [train_local(one, data[k], configs[k]) for k, (one, _) in enumerate(pairs)]
    together = train_batched([two for _, two in pairs], data, configs)
    for k, (one, two) in enumerate(pairs):
        assert together[k].steps == alone[k].steps == 6
        assert together[k].mean_loss == pytest.approx(alone[k].mean_loss, rel=RTOL, abs=ATOL)
        expected, got = one.model.state_dict(), two.model.state_dict()
        assert expected.keys() == got.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=ATOL, rtol=RTOL, msg=f"device {k}: {name}")
        moved = any((expected[n] - tensors[n]).abs().max() > 1e-3 for n in tensors if tensors[n].is_floating_point())
        assert moved, "training changed nothing: the comparison would prove nothing"


def assignment(spec: SpecBase) -> dict[str, torch.Tensor]:
    """A freshly initialized model of ``spec``'s program, as the coordinator's first assignment."""
    torch.manual_seed(0)
    return {k: v.clone() for k, v in PROGRAMS.get(spec.strategy).build_model(spec).state_dict().items()}


@pytest.mark.parametrize("level", [1.0, 0.5, 0.25])
def test_fedhm_factorized_levels_train_batched_as_one_by_one(level: float) -> None:
    spec = FedHMSpec(strategy="fedhm", model=CNN, level=level, frobenius_decay=1e-3, send_classes=True)
    assert_same_training(spec, assignment(spec))


@pytest.mark.parametrize(("level", "scaler"), [(1.0, False), (0.5, True), (0.25, True)])
def test_width_slices_train_batched_as_one_by_one(level: float, scaler: bool) -> None:
    """HeteroFL's width slices, with its Scaler (convolution outputs x 1/rate in training); the CNN has BatchNorm."""
    spec = WidthSpec(strategy="heterofl", model=CNN, level=level, scaler=scaler, send_classes=True)
    assert_same_training(spec, assignment(spec))


def test_batchnorm_statistics_stay_each_devices_own() -> None:
    """The CNN's BatchNorm running statistics are trained per device: batched, each device ends with its own."""
    spec = WidthSpec(strategy="fedavg", model=CNN, level=1.0, scaler=False, send_classes=False)
    tensors = assignment(spec)
    programs_ = [build_program(spec, tensors) for _ in range(2)]
    train_batched(programs_, [shard(0, spec), shard(1, spec)], [TRAIN, TRAIN])
    first, second = (p.model.state_dict()["bn1.running_mean"] for p in programs_)
    assert not torch.allclose(first, second)
    assert_same_training(spec, tensors)


def test_lora_adapters_train_batched_as_one_by_one() -> None:
    model = ModelSpec("vit_tiny", 10, 1, 8)
    probe = LoRASpec(
        strategy="fedlora",
        model=model,
        level=0.5,
        rank=4,
        alpha=8.0,
        scale="alpha_over_r",
        targets="attn",
        adapter_layout="separate",
        train_head=True,
        base_sha256="0" * 64,
    )
    torch.manual_seed(0)
    built = LoRAProgram.build_model(probe)
    base = base_state(built)
    spec = probe.model_copy(update={"base_sha256": state_digest(base)})
    assert_same_training(spec, {k: v.clone() for k, v in built.state_dict().items()}, frozenset(base))


def test_a_device_at_its_first_step_batches_with_one_at_its_second() -> None:
    """In a worker, devices reach the same step shape at different steps: momentum starts per device."""
    spec = WidthSpec(strategy="fedavg", model=CNN, level=1.0, scaler=False, send_classes=False)
    tensors = assignment(spec)
    config = TRAIN.model_copy(update={"epochs": 1, "batch_size": 10})
    (a1, a2), (b1, b2) = programs(spec, tensors, 0), programs(spec, tensors, 1)
    train_local(a1, shard(0, spec), config)
    train_local(b1, shard(1, spec), config)
    a, b = DeviceTrainer(a2, shard(0, spec), config), DeviceTrainer(b2, shard(1, spec), config)
    single_step(a, 0)
    batched_step([a, b], [1, 0])  # a's second step and b's first, as one
    single_step(b, 1)
    for one, two in ((a1, a2), (b1, b2)):
        for name, value in one.model.state_dict().items():
            torch.testing.assert_close(two.model.state_dict()[name], value, atol=ATOL, rtol=RTOL)


def test_what_cannot_batch_says_why_and_trains_one_by_one() -> None:
    spec = WidthSpec(strategy="fedavg", model=CNN, level=1.0, scaler=False, send_classes=False)
    tensors = assignment(spec)
    adam = TRAIN.model_copy(update={"optimizer": "adam", "momentum": 0.0})
    one, two = programs(spec, tensors, 0)
    assert unbatchable(two, adam) == "Adam (batched steps implement the agent's SGD only)"
    with pytest.raises(ValueError, match="cannot batch this device's training: Adam"):
        DeviceTrainer(two, shard(0, spec), adam)
    alone = train_local(one, shard(0, spec), adam)
    (fallback,) = train_batched([two], [shard(0, spec)], [adam])
    assert fallback.mean_loss == alone.mean_loss
    for name, value in one.model.state_dict().items():
        assert torch.equal(two.model.state_dict()[name], value)


def test_steps_taken_alone_are_train_locals_bit_for_bit() -> None:
    """A worker's batcher runs a step alone where batching does not pay: the same numbers as the agent's own loop."""
    spec = FedHMSpec(strategy="fedhm", model=CNN, level=0.5, frobenius_decay=1e-3, send_classes=True)
    one, two = programs(spec, assignment(spec), 0)
    alone = train_local(one, shard(0, spec), TRAIN)
    stepwise = train_stepwise(two, shard(0, spec), TRAIN, "cpu", single_step)
    assert (stepwise.steps, stepwise.mean_loss) == (alone.steps, alone.mean_loss)
    for name, value in one.model.state_dict().items():
        assert torch.equal(two.model.state_dict()[name], value), name
