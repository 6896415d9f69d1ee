"""LoRA adapter options as the strategies see them: fused_qkv layout, the scale kind, a frozen head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.clients import build_program
from device_agent.clients.spec import parse_spec
from device_agent.layers.lora import lora_layers, lora_scale
from device_agent.models import build_model
from device_agent.training.optimizer import TrainConfig, train_local

VIT = ModelSpec("vit_tiny", 10, 1, 8)
SLOTS = [ClientSlot("a", 1.0, 16), ClientSlot("b", 0.25, 16)]
TRAIN = TrainConfig(optimizer="adam", lr=1e-2, batch_size=8, mask_absent_classes=False)
QKV = "blocks.1.attn.qkv"


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _round(name: str, params: dict) -> tuple:
    """One round of ``name`` over SLOTS with real client programs; returns (strategy, uploads, ranks, base)."""
    strategy = build_strategy(name, VIT, params, seed=4)
    base = {k: v.clone() for k, v in strategy.base.items()}
    sent = strategy.configure(1, SLOTS)
    aggregate = strategy.open_round(1, SLOTS)
    uploads, ranks = {}, {}
    for index, slot in enumerate(SLOTS):
        assignment = sent[slot.client_id]
        r = ranks[slot.client_id] = assignment.spec.rank
        assert tuple(assignment.tensors[f"{QKV}.reduce"].shape) == (r, 64)
        assert tuple(assignment.tensors[f"{QKV}.expand"].shape) == (192, r)
        program = build_program(assignment.spec, assignment.tensors)
        train_local(program, _data(index), TRAIN)
        upload = uploads[slot.client_id] = program.upload()
        assert {k: tuple(v.shape) for k, v in upload.items()} == strategy.expected_upload(slot.level)
        aggregate.add(slot.client_id, upload, slot.num_samples)
    strategy.close_round(aggregate)
    return strategy, uploads, ranks, base


@pytest.mark.parametrize("name", ["fedlora", "lora_homogeneous", "hetlora", "flora"])
def test_every_lora_strategy_runs_a_round_with_fused_qkv_and_its_update_reaches_q_k_and_v(name: str) -> None:
    strategy, uploads, _, base = _round(name, {"adapter_layout": "fused_qkv"})

    assert strategy.layers[QKV] == (192, 64) and strategy.layers["blocks.1.attn.proj"] == (64, 64)
    assert not any(".attn.q.reduce" in key for upload in uploads.values() for key in upload)
    merged = strategy.global_state()
    assert merged.keys() == build_model("vit_tiny", 10, 1).state_dict().keys()
    for part in "qkv":
        assert not torch.equal(merged[f"blocks.1.attn.{part}.weight"], base[f"blocks.1.attn.{part}.weight"]), part
    strategy.global_model()  # loads into the plain ViT
    nxt = strategy.configure(2, SLOTS)
    for slot in SLOTS:
        r = nxt[slot.client_id].spec.rank
        assert tuple(nxt[slot.client_id].tensors[f"{QKV}.expand"].shape) == (192, r)


@pytest.mark.parametrize("scale", ["alpha_over_r", "one", "rslora"])
def test_fedlora_with_fused_qkv_averages_each_clients_scaled_b_a_and_splits_it_over_q_k_v(scale: str) -> None:
    strategy, uploads, ranks, base = _round(
        "fedlora", {"adapter_layout": "fused_qkv", "scale": scale, "weighting": "uniform"}
    )

    deltas = [
        lora_scale(scale, 16.0, ranks[c]) * up[f"{QKV}.expand"].double() @ up[f"{QKV}.reduce"].double()
        for c, up in uploads.items()
    ]
    mean = (deltas[0] + deltas[1]) / 2
    merged = strategy.global_state()
    for index, part in enumerate("qkv"):
        rows = slice(64 * index, 64 * (index + 1))
        key = f"blocks.1.attn.{part}.weight"
        torch.testing.assert_close(merged[key].double(), base[key].double() + mean[rows], atol=1e-6, rtol=1e-5)


def test_the_scale_reaches_the_device() -> None:
    strategy = build_strategy("fedlora", VIT, {"adapter_layout": "fused_qkv", "scale": "rslora", "alpha": 8.0})
    assignment = strategy.configure(1, [ClientSlot("a", 0.25, 16)])["a"]
    program = build_program(assignment.spec, assignment.tensors)
    assert {layer.scale for layer in lora_layers(program.model).values()} == {8.0 / 2.0}  # alpha / sqrt(4)


def test_an_upload_in_the_other_layout_is_rejected() -> None:
    strategy = build_strategy("fedlora", VIT, {"adapter_layout": "fused_qkv"})
    separate = build_strategy("fedlora", VIT)
    upload = {k: torch.zeros(shape) for k, shape in separate.expected_upload(1.0).items()}
    with pytest.raises(UpdateRejected, match=r"not a tensor a device at this level sends") as refused:
        strategy.upload_contract(SLOTS[0]).check(upload)
    assert refused.value.reason == "unknown_tensor"


def test_a_frozen_head_is_sent_with_the_base_and_never_uploaded() -> None:
    strategy = build_strategy("fedlora", VIT, {"train_head": False, "adapter_layout": "fused_qkv"}, seed=1)
    assignment = strategy.configure(1, SLOTS[:1])["a"]
    program = build_program(assignment.spec, assignment.tensors)
    head = program.model.head.weight.detach().clone()

    train_local(program, _data(0), TRAIN)

    assert "head.weight" in assignment.tensors and "head.weight" in strategy.base
    assert not any(key.startswith("head.") for key in program.upload())
    assert not any(key.startswith("head.") for key in strategy.expected_upload(1.0))
    assert torch.equal(program.model.head.weight, head)


def test_a_frozen_head_needs_a_checkpoint_head_that_fits(tmp_path: Path) -> None:
    state = build_model("vit_tiny", 5, 1).state_dict()  # a 5-class head; the task has 10
    save_file(state, str(tmp_path / "base.safetensors"))
    params = {"base_checkpoint": str(tmp_path / "base.safetensors"), "train_head": False}
    with pytest.raises(ValueError, match=r"train_head: false .* head\.weight \(5, 64\).* needs \(10, 64\)"):
        build_strategy("fedlora", VIT, params)
    build_strategy("fedlora", VIT, {**params, "train_head": True})  # a new head from zero is fine


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("adapter_layout", "fused", r"adapter_layout: Input should be 'separate' or 'fused_qkv'"),
        ("scale", "sqrt", r"scale: Input should be 'alpha_over_r', 'one' or 'rslora'"),
        ("train_head", "maybe", r"train_head: Input should be a valid boolean"),
    ],
)
def test_bad_options_are_named_by_the_strategy_and_by_the_device_spec(key: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_strategy("fedlora", VIT, {key: value})
    raw = build_strategy("fedlora", VIT).spec(VIT, build_strategy("fedlora", VIT).params, 1.0, "0" * 64).model_dump()
    with pytest.raises(ValueError, match=rf"spec\.{message}"):
        parse_spec({**raw, key: value})
