"""hetlora and flora as strategies: what the server keeps after a round and what each client then receives."""

from __future__ import annotations

import torch

from coordinator.algorithms.lora import ClientFactors, sparsity_weights, zero_pad_average
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from coordinator.strategies.lora_rules import FLoRA, HetLoRA

VIT = ModelSpec("vit_tiny", 10, 1, 8)
SLOTS = [ClientSlot("big", 1.0, 30), ClientSlot("small", 0.25, 10)]  # ranks 16 and 4 (max_rank 16)


def _round(strategy: HetLoRA | FLoRA) -> dict[str, dict[str, torch.Tensor]]:
    """One round in which each client uploads random factors and head of its shapes; returns the uploads."""
    strategy.configure(1, SLOTS)
    aggregate = strategy.open_round(1, SLOTS)
    uploads = {}
    for index, slot in enumerate(SLOTS):
        gen = torch.Generator().manual_seed(index)
        shapes = strategy.expected_upload(slot.level)
        uploads[slot.client_id] = {k: torch.randn(shape, generator=gen) for k, shape in shapes.items()}
        aggregate.check(slot.client_id, uploads[slot.client_id], slot.num_samples)
        aggregate.fold(slot.client_id, uploads[slot.client_id], slot.num_samples)
    strategy.close_round(aggregate)
    return uploads


def _effective(upload: dict[str, torch.Tensor], layer: str, rank: int, weight: float) -> ClientFactors:
    scale = 16.0 / rank  # alpha 16
    return ClientFactors(scale * upload[f"{layer}.expand"].double(), upload[f"{layer}.reduce"].double(), weight)


def test_hetlora_keeps_the_sparsity_weighted_padded_average_and_sends_each_rank_its_leading_part() -> None:
    strategy = build_strategy("hetlora", VIT, seed=1)
    uploads = _round(strategy)
    layer = next(iter(strategy.layers))
    clients = [_effective(uploads["big"], layer, 16, 30), _effective(uploads["small"], layer, 4, 10)]

    reduce, expand = zero_pad_average(clients, 16, sparsity_weights(clients))

    torch.testing.assert_close(strategy.state[f"{layer}.reduce"], reduce.float())
    torch.testing.assert_close(strategy.state[f"{layer}.expand"], expand.float())
    sent = strategy.configure(2, SLOTS)["small"].tensors
    update = (16.0 / 4) * sent[f"{layer}.expand"].double() @ sent[f"{layer}.reduce"].double()
    torch.testing.assert_close(update, expand[:, :4] @ reduce[:4], rtol=1e-5, atol=1e-5)
    assert not any(key.endswith(".weight") and key.startswith("blocks.") for key in sent)  # the base stays put


def test_flora_merges_the_exact_weighted_sum_of_products_into_the_base_and_sends_fresh_adapters() -> None:
    strategy = build_strategy("flora", VIT, seed=1)
    before = {k: v.clone() for k, v in strategy.base.items()}
    first = strategy.configure(1, SLOTS)
    uploads = _round(strategy)

    for layer in strategy.layers:
        big, small = _effective(uploads["big"], layer, 16, 30), _effective(uploads["small"], layer, 4, 10)
        expected = (
            before[f"{layer}.weight"].double() + 0.75 * big.expand @ big.reduce + 0.25 * small.expand @ small.reduce
        )
        torch.testing.assert_close(strategy.base[f"{layer}.weight"], expected.float())
    second = strategy.configure(2, SLOTS)
    for slot in SLOTS:
        sent = second[slot.client_id]
        assert sent.spec.base_sha256 == strategy.digest != first[slot.client_id].spec.base_sha256
        assert all(torch.equal(sent.tensors[k], v) for k, v in strategy.base.items())  # the merged base, to all
        layer = next(iter(strategy.layers))
        assert not sent.tensors[f"{layer}.expand"].any()  # B = 0: the merged model, unchanged
        assert not torch.equal(sent.tensors[f"{layer}.reduce"], first[slot.client_id].tensors[f"{layer}.reduce"])
    torch.testing.assert_close(strategy.global_state()[f"{layer}.weight"], strategy.base[f"{layer}.weight"])


def test_flora_state_round_trips_with_the_merged_base() -> None:
    strategy = build_strategy("flora", VIT, seed=1)
    _round(strategy)
    restored = build_strategy("flora", VIT, seed=1)

    restored.load_state_dict(strategy.state_dict())

    assert restored.digest == strategy.digest and restored.merges == 1
    layer = next(iter(strategy.layers))
    sent, again = strategy.configure(2, SLOTS)["big"].tensors, restored.configure(2, SLOTS)["big"].tensors
    assert torch.equal(sent[f"{layer}.reduce"], again[f"{layer}.reduce"])
