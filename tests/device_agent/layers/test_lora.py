"""The LoRA layer: it wraps its frozen base (PEFT style), merges with a finiteness check, keeps the plain keys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from device_agent.layers.lora import (
    LoRALinear,
    apply_lora,
    base_state,
    delta_targets,
    exchanged_keys,
    lora_layers,
    lora_scale,
    merge_lora,
)
from device_agent.models import build_model


def _layer(scale: float = 2.0, dtype: torch.dtype = torch.float32) -> tuple[nn.Linear, LoRALinear]:
    torch.manual_seed(0)
    base = nn.Linear(12, 9).to(dtype)
    return base, LoRALinear(base, rank=3, scale=scale, name="blocks.0.attn.q")


def test_the_layer_holds_its_base_module_frozen_and_equals_it_at_init() -> None:
    base, layer = _layer()
    x = torch.randn(5, 12)

    assert layer.base_layer is base
    assert not any(p.requires_grad for p in base.parameters())
    assert {n for n, p in layer.named_parameters() if p.requires_grad} == {"reduce", "expand"}
    torch.testing.assert_close(layer(x), base(x))


def test_the_state_dict_keeps_the_plain_linear_keys_and_loads_back() -> None:
    base, layer = _layer()
    state = layer.state_dict()

    assert set(state) == {"weight", "bias", "reduce", "expand"}
    assert state["weight"] is not None and torch.equal(state["weight"], base.weight)
    other = LoRALinear(nn.Linear(12, 9), rank=3, scale=2.0)
    other.load_state_dict(state)
    torch.testing.assert_close(other.base_layer.weight, base.weight)


def test_merge_equals_forward_and_unmerge_restores_the_base() -> None:
    base, layer = _layer()
    nn.init.normal_(layer.expand)
    original = base.weight.detach().clone()
    x = torch.randn(5, 12)
    before = layer(x)

    layer.merge()

    torch.testing.assert_close(base.weight, original + 2.0 * layer.expand @ layer.reduce)
    torch.testing.assert_close(layer(x), before)
    layer.unmerge()
    torch.testing.assert_close(base.weight, original)


def test_training_moves_only_the_adapter() -> None:
    base, layer = _layer()
    original = {k: v.detach().clone() for k, v in base.state_dict().items()}
    optimizer = torch.optim.SGD([p for p in layer.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        layer(torch.randn(8, 12)).square().sum().backward()
        optimizer.step()

    assert layer.expand.abs().sum() > 0
    for key, value in base.state_dict().items():
        assert torch.equal(value, original[key]), key


def test_a_non_finite_merge_is_refused_naming_the_layer_and_leaves_the_base() -> None:
    base, layer = _layer()
    original = base.weight.detach().clone()
    with torch.no_grad():
        layer.expand[0, 0] = float("inf")

    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.q.*non-finite"):
        layer.merge()
    assert torch.equal(base.weight, original)
    assert not layer.merged


def test_a_merge_that_overflows_an_fp16_base_is_refused() -> None:
    _, layer = _layer(dtype=torch.float16)
    with torch.no_grad():
        layer.expand.fill_(1e3)  # finite in float32, B A * 2 is far beyond fp16's 65504
        layer.reduce.fill_(1e2)

    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.q.*torch\.float16"):
        layer.merge()


def test_an_fp16_base_stays_fp16_runs_on_float32_inputs_and_merges() -> None:
    base, layer = _layer(dtype=torch.float16)
    nn.init.normal_(layer.expand, std=0.01)
    x = torch.randn(5, 12)

    out = layer(x)

    assert base.weight.dtype == torch.float16 and layer.reduce.dtype == torch.float32
    assert out.dtype == torch.float32
    expected = base(x.half()).float() + 2.0 * (x @ layer.reduce.T @ layer.expand.T)
    torch.testing.assert_close(out, expected)
    layer.merge()
    assert base.weight.dtype == torch.float16
    torch.testing.assert_close(layer(x), out, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("layout", ["separate", "fused_qkv"])
def test_on_the_vit_forward_equals_the_base_at_init_and_merging_all_equals_forward(layout: str) -> None:
    model = build_model("vit_tiny", 10, 1)
    plain_keys = set(model.state_dict())
    x = torch.randn(3, 1, 8, 8)
    reference = model(x)

    apply_lora(model, 4, 1.0, ("q", "k", "v", "proj"), layout=layout)  # type: ignore[arg-type]

    torch.testing.assert_close(model(x), reference)
    assert set(base_state(model)) == plain_keys - {"head.weight", "head.bias"}
    for adapter in lora_layers(model).values():
        nn.init.normal_(adapter.expand, std=0.05)
    adapted = model(x)
    merge_lora(model)
    torch.testing.assert_close(model(x), adapted, atol=1e-5, rtol=1e-4)


def test_fused_qkv_shares_one_adapter_over_q_k_v_whose_row_blocks_update_each() -> None:
    model = build_model("vit_tiny", 10, 1)
    apply_lora(model, 2, 1.0, ("q", "k", "v", "proj"), trainable=(), layout="fused_qkv")

    layers = lora_layers(model)
    assert {n for n in layers if n.startswith("blocks.0.")} == {"blocks.0.attn.qkv", "blocks.0.attn.proj"}
    assert tuple(layers["blocks.0.attn.qkv"].expand.shape) == (192, 2)
    assert tuple(layers["blocks.0.attn.qkv"].reduce.shape) == (2, 64)
    assert [(k, r.start, r.stop) for k, r in delta_targets(model)["blocks.0.attn.qkv"]] == [
        ("blocks.0.attn.q.weight", 0, 64),
        ("blocks.0.attn.k.weight", 64, 128),
        ("blocks.0.attn.v.weight", 128, 192),
    ]
    pairs = [(m, f) for m in ("qkv", "proj") for f in ("reduce", "expand")]
    assert set(exchanged_keys(model)) == {f"blocks.{i}.attn.{m}.{f}" for i in range(4) for m, f in pairs}


@pytest.mark.parametrize("rank", [2, 16])
def test_fused_qkv_on_vit_small_trains_the_papers_27648_r_parameters(rank: int) -> None:
    with torch.device("meta"):
        fused = apply_lora(build_model("vit_small", 10, 3), rank, 1.0, ("q", "k", "v", "proj"), (), "fused_qkv")
        separate = apply_lora(build_model("vit_small", 10, 3), rank, 1.0, ("q", "k", "v", "proj"), (), "separate")

    def count(model: nn.Module) -> int:
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    assert count(fused) == 27_648 * rank  # 0.06 M at r 2, 0.44 M at r 16: the paper's Fig. 8 sizes
    assert count(separate) == 36_864 * rank


def test_fused_qkv_without_q_k_v_targets_is_refused() -> None:
    with pytest.raises(ValueError, match="fused_qkv needs q, k and v"):
        apply_lora(build_model("vit_tiny", 10, 1), 2, 1.0, ("proj",), layout="fused_qkv")


def test_the_scale_kinds() -> None:
    assert lora_scale("alpha_over_r", 16, 4) == 4.0
    assert lora_scale("one", 16, 4) == 1.0
    assert lora_scale("rslora", 16, 4) == 8.0
