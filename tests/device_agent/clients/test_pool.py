"""A model given back after a round is reused by the next program of its spec, as if freshly built."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import device_agent.clients.base as base
from device_agent.clients import build_program
from device_agent.clients.pool import ModelPool, Pooled
from device_agent.clients.spec import TrainConfig, parse_spec
from device_agent.layers.hybrid import hybrid
from device_agent.models import build_model
from device_agent.training.local_round import train_assignment

MODEL = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8}
FEDAVG = parse_spec({"strategy": "fedavg", "model": MODEL, "level": 1.0, "scaler": False, "send_classes": False})
FEDHM = parse_spec({"strategy": "fedhm", "model": MODEL, "level": 0.5, "frobenius_decay": 1e-3, "send_classes": True})


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModelPool]:
    fresh = ModelPool()
    monkeypatch.setattr(base, "MODELS", fresh)
    yield fresh


def shards(seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    train = (torch.rand(12, 1, 8, 8, generator=g), torch.randint(0, 10, (12,), generator=g))
    test = (torch.rand(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g))
    return train, test


def one_round(spec, tensors):
    train, test = shards(1)
    return train_assignment(spec, TrainConfig(epochs=2, batch_size=4), tensors, None, train, test)


@pytest.mark.parametrize(
    ("spec", "weights"), [(FEDAVG, lambda: build_model("cnn")), (FEDHM, lambda: hybrid("cnn", 0.5))]
)
def test_a_reused_model_trains_exactly_as_a_fresh_one(pool: ModelPool, spec, weights) -> None:
    torch.manual_seed(0)
    tensors = {k: v for k, v in weights().state_dict().items() if "running" not in k and "num_batches" not in k}
    fresh = one_round(spec, tensors)
    assert pool.idle_bytes > 0  # the round gave its model back
    taken = build_program(spec, tensors)
    assert pool.idle_bytes == 0  # ... and the next program of the spec took it
    taken.release({})
    reused = one_round(spec, tensors)
    assert reused.upload.keys() == fresh.upload.keys()
    for key, value in fresh.upload.items():
        assert torch.equal(reused.upload[key], value), key
    assert reused.local_accuracy == fresh.local_accuracy and reused.received == fresh.received
    assert reused.result.mean_loss == fresh.result.mean_loss


def test_a_reused_model_has_fresh_norm_statistics_momentum_and_no_gradients(pool: ModelPool) -> None:
    tensors = {k: v for k, v in build_model("cnn").state_dict().items() if "running" not in k}
    first = build_program(FEDAVG, tensors)
    norms = [m for m in first.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    first.model(torch.rand(4, 1, 8, 8)).sum().backward()
    for norm in norms:
        norm.momentum = None  # what static BN calibration leaves
    first.release({})
    second = build_program(FEDAVG, tensors)
    assert second.model is first.model
    assert all(norm.momentum == 0.1 and int(norm.num_batches_tracked) == 0 for norm in norms)
    assert all(torch.equal(norm.running_mean, torch.zeros_like(norm.running_mean)) for norm in norms)
    assert all(p.grad is None for p in second.model.parameters())


def test_a_model_sharing_memory_with_what_was_sent_is_not_reused(pool: ModelPool) -> None:
    tensors = {k: v for k, v in build_model("cnn").state_dict().items() if "running" not in k}
    program = build_program(FEDAVG, tensors)
    program.release({"conv1.weight": program.model.conv1.weight.detach()})  # an upload without a copy
    assert pool.idle_bytes == 0 and build_program(FEDAVG, tensors).model is not program.model


def test_hooked_or_frozen_models_are_not_kept_and_the_pool_holds_its_bound() -> None:
    pool = ModelPool(max_bytes=Pooled.fresh(build_model("cnn")).nbytes)
    hooked = Pooled.fresh(build_model("cnn"))
    hooked.model.conv1.register_forward_hook(lambda *_: None)
    frozen = Pooled.fresh(build_model("cnn"))
    frozen.model.conv1.weight.requires_grad_(False)
    assert not pool.give("k", hooked) and not pool.give("k", frozen)
    assert pool.give("k", Pooled.fresh(build_model("cnn")))
    assert not pool.give("k", Pooled.fresh(build_model("cnn")))  # over max_bytes
    assert pool.take("k") is not None and pool.take("k") is None and pool.take("other") is None


def test_a_program_overriding_load_says_whether_its_model_is_reused_or_is_warned(pool: ModelPool) -> None:
    # Overriding load used to turn the pool off without a word; after_load keeps it, an unsaid override warns.
    fedavg = type(build_program(FEDAVG, build_model("cnn", 10, 1).state_dict()))

    class Noted(fedavg, register=False):
        def after_load(self, tensors, local):
            self.received = sorted(tensors)

    weights = build_model("cnn", 10, 1).state_dict()
    noted = Noted(FEDAVG, weights)
    assert noted.received == sorted(weights) and noted._pooled is not None  # after_load ran, on a pooled model
    with pytest.warns(UserWarning, match="overrides ClientProgram.load without saying"):

        class OwnLoad(fedavg, register=False):
            def load(self, tensors, local):
                super().load(tensors, local)

    assert not OwnLoad._reuses_model()

    class Writes(fedavg, register=False):
        reuse_model = True

        def load(self, tensors, local):
            super().load(tensors, local)

    assert Writes._reuses_model()
