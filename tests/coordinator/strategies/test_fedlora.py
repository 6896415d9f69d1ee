"""FedLoRA: the LoRA layer, what a device uploads and keeps, and the server's per-rank re-factorization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.algorithms.lora import lora_factors
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.clients import build_program
from device_agent.clients.base import KeptStateMissing
from device_agent.layers.lora import apply_lora, base_state
from device_agent.models import build_model
from device_agent.models.vit import convert_checkpoint
from device_agent.training.optimizer import TrainConfig, train_local

VIT = ModelSpec("vit_tiny", 10, 1, 8)


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def test_a_fresh_adapter_leaves_the_pretrained_model_unchanged() -> None:
    model = build_model("vit_tiny", 10, 1)
    x = torch.randn(3, 1, 8, 8)
    reference = model(x)
    apply_lora(model, 4, 16.0, ("q", "k", "v", "proj"))
    torch.testing.assert_close(model(x), reference)
    assert {n for n, p in model.named_parameters() if p.requires_grad} >= {"head.weight", "blocks.0.attn.q.reduce"}


@pytest.mark.parametrize("name", ["fedlora", "lora_homogeneous"])
def test_a_frozen_base_weight_never_appears_in_an_upload_and_is_not_trained(name: str) -> None:
    strategy = build_strategy(name, VIT, seed=1)
    [assignment] = strategy.configure(1, [ClientSlot("c0", 0.25, 16)]).values()
    program = build_program(assignment.spec, assignment.tensors)
    frozen = {k: v.clone() for k, v in base_state(program.model).items()}

    train_local(program, _data(0), TrainConfig(optimizer="adam", lr=1e-2, batch_size=8, mask_absent_classes=False))
    upload = program.upload()

    assert not set(upload) & set(frozen)
    assert set(upload) == {n for n, p in program.model.named_parameters() if p.requires_grad}
    assert all(k.endswith((".reduce", ".expand")) or k.startswith("head.") for k in upload)
    for key, value in base_state(program.model).items():
        torch.testing.assert_close(value, frozen[key], msg=key)


def test_the_server_refactorization_is_the_best_rank_r_approximation_for_every_rank() -> None:
    torch.manual_seed(0)
    delta = torch.randn(24, 20, dtype=torch.float64)
    scales = {2: 8.0, 4: 4.0, 8: 2.0}
    singular = torch.linalg.svdvals(delta)

    for r, (reduce, expand) in lora_factors(delta, scales).items():
        approx = scales[r] * expand @ reduce
        error = torch.linalg.matrix_norm(delta - approx)
        assert torch.linalg.matrix_rank(approx) == r
        torch.testing.assert_close(error, singular[r:].square().sum().sqrt())  # Eckart-Young optimum
        torch.testing.assert_close(reduce @ reduce.T, torch.eye(r, dtype=torch.float64))  # every row of A live


def test_fedlora_aggregates_updates_weighted_and_refactorizes_per_rank() -> None:
    strategy = build_strategy("fedlora", VIT, {"weighting": "uniform"}, seed=2)
    slots = [ClientSlot("a", 1.0, 16), ClientSlot("b", 0.125, 16)]
    sent = strategy.configure(1, slots)
    aggregate = strategy.open_round(1, slots)
    uploads = {}
    for index, slot in enumerate(slots):
        program = build_program(sent[slot.client_id].spec, sent[slot.client_id].tensors)
        train_local(program, _data(index), TrainConfig(optimizer="adam", lr=1e-2, batch_size=8))
        uploads[slot.client_id] = (program.upload(), program.spec.rank)
        aggregate.add(slot.client_id, uploads[slot.client_id][0], 16)
    strategy.close_round(aggregate)

    layer = "blocks.1.attn.v"
    deltas = [16.0 / r * up[f"{layer}.expand"] @ up[f"{layer}.reduce"] for up, r in uploads.values()]
    mean = (deltas[0] + deltas[1]) / 2
    torch.testing.assert_close(strategy.global_state()[f"{layer}.weight"], strategy.base[f"{layer}.weight"] + mean)
    nxt = strategy.configure(2, [ClientSlot("b", 0.125, 16)])["b"]
    assert nxt.spec.rank == 2
    approx = 8.0 * nxt.tensors[f"{layer}.expand"] @ nxt.tensors[f"{layer}.reduce"]
    u, s, vh = torch.linalg.svd(mean.double())
    torch.testing.assert_close(approx.double(), (u[:, :2] * s[:2]) @ vh[:2], atol=1e-5, rtol=1e-4)


def test_the_base_is_sent_once_kept_on_the_device_and_hash_checked() -> None:
    strategy = build_strategy("fedlora", VIT, seed=3)
    slot = ClientSlot("c0", 0.5, 16)
    first = strategy.configure(1, [slot])["c0"]
    program = build_program(first.spec, first.tensors)
    aggregate = strategy.open_round(1, [slot])
    aggregate.add("c0", program.upload(), 16)
    strategy.close_round(aggregate)
    kept = program.keep()

    second = strategy.configure(2, [slot])["c0"]

    assert set(kept) <= set(first.tensors) and not set(kept) & set(second.tensors)
    assert strategy.download_bytes(VIT, strategy.params, 0.5) == sum(t.nbytes for t in first.tensors.values())
    build_program(second.spec, second.tensors, kept)
    with pytest.raises(KeptStateMissing, match="lacks"):
        build_program(second.spec, second.tensors, None)
    tampered = {**kept, "norm.weight": kept["norm.weight"] + 1}
    with pytest.raises(KeptStateMissing, match="digest"):
        build_program(second.spec, second.tensors, tampered)
    strategy.forget("c0")
    assert set(kept) <= set(strategy.configure(3, [slot])["c0"].tensors)


def test_a_timm_checkpoint_maps_onto_the_vit_with_qkv_split() -> None:
    model = build_model("vit_tiny", 10, 1)
    ours = model.state_dict()
    timm = {k: v for k, v in ours.items() if ".attn.q." not in k and ".attn.k." not in k and ".attn.v." not in k}
    for i in range(4):
        for kind in ("weight", "bias"):
            parts = [ours[f"blocks.{i}.attn.{n}.{kind}"] for n in "qkv"]
            timm[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(parts)

    converted = convert_checkpoint(timm)

    assert converted.keys() == ours.keys()
    assert all(torch.equal(converted[k], ours[k]) for k in ours)


def test_a_missing_base_checkpoint_says_how_to_write_one(tmp_path: Path) -> None:
    missing = tmp_path / "base.safetensors"
    with pytest.raises(ValueError, match=f"coordinator pretrain --arch vit_tiny --out {missing}"):
        build_strategy("fedlora", VIT, {"base_checkpoint": str(missing)})
