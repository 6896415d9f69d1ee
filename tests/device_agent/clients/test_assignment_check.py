"""An assignment's tensors must be the model's own: every misfit is named, none is cast to fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from device_agent.clients.assignment_check import BadAssignment, Input, check_assignment

MODEL = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).state_dict()
NORM_STATISTICS = ("1.running_mean", "1.running_var", "1.num_batches_tracked")


def sent(changes: dict[str, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
    """The model's own tensors, with some replaced, or dropped (None)."""
    tensors = {key: value.clone() for key, value in MODEL.items()}
    for key, value in (changes or {}).items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    return tensors


def test_the_model_own_tensors_fit_and_optional_ones_may_be_absent() -> None:
    check_assignment(sent(), MODEL)
    without_statistics = {k: v for k, v in sent().items() if k not in NORM_STATISTICS}
    check_assignment(without_statistics, MODEL, optional=NORM_STATISTICS)


def test_missing_and_unexpected_tensors_are_named() -> None:
    with pytest.raises(BadAssignment, match=r"missing '0.bias'; not in the model: 'extra'$"):
        check_assignment({**sent({"0.bias": None}), "extra": torch.zeros(2)}, MODEL)


def test_a_tensor_of_another_shape_is_named_with_the_shape_expected() -> None:
    with pytest.raises(BadAssignment, match=r"'0.weight' has shape \(3, 2\), expected \(2, 3\)$"):
        check_assignment(sent({"0.weight": torch.zeros(3, 2)}), MODEL)
    with pytest.raises(BadAssignment, match=r"'0.bias' has shape \(\), expected \(2,\)$"):
        check_assignment(sent({"0.bias": torch.tensor(1.0)}), MODEL)


@pytest.mark.parametrize(
    "dtype", [torch.complex64, torch.int64, torch.int32, torch.bool, torch.float64, torch.float16, torch.bfloat16]
)
def test_a_float_tensor_of_any_other_dtype_is_refused_not_cast(dtype: torch.dtype) -> None:
    with pytest.raises(BadAssignment, match=rf"'0.weight' is {dtype}, expected torch.float32$"):
        check_assignment(sent({"0.weight": torch.ones(2, 3, dtype=dtype)}), MODEL)


def test_an_integer_buffer_takes_any_integer_dtype_and_nothing_else() -> None:
    check_assignment(sent({"1.num_batches_tracked": torch.tensor(7, dtype=torch.int32)}), MODEL)
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(BadAssignment, match=rf"is {dtype}, expected an integer dtype like torch.int64$"):
            check_assignment(sent({"1.num_batches_tracked": torch.tensor(7, dtype=dtype)}), MODEL)


def test_non_finite_values_are_counted() -> None:
    weight = torch.tensor([[1.0, float("nan"), 0.0], [float("inf"), 0.0, -float("inf")]])
    with pytest.raises(BadAssignment, match=r"'0.weight' has 3 non-finite values$"):
        check_assignment(sent({"0.weight": weight}), MODEL)


def test_one_message_names_the_first_few_misfits_and_counts_the_rest() -> None:
    model = {f"w{i}": torch.zeros(2) for i in range(8)}
    tensors = {key: torch.zeros(2, dtype=torch.float64) for key in model}
    with pytest.raises(BadAssignment) as refused:
        check_assignment(tensors, model)
    assert str(refused.value) == (
        "assignment does not fit the model: "
        + "; ".join(f"'w{i}' is torch.float64, expected torch.float32" for i in range(5))
        + "; 3 more tensors that do not fit"
    )


def test_an_input_beside_the_model_must_be_there_with_its_shape_any_batch_size() -> None:
    criteria = {"criteria": Input((None, 1, 8, 8))}
    check_assignment({**sent(), "criteria": torch.randn(3, 1, 8, 8)}, MODEL, inputs=criteria)
    with pytest.raises(BadAssignment, match=r"missing 'criteria'$"):
        check_assignment(sent(), MODEL, inputs=criteria)
    with pytest.raises(BadAssignment, match=r"'criteria' has shape \(3, 3, 8, 8\), expected \(any, 1, 8, 8\)$"):
        check_assignment({**sent(), "criteria": torch.randn(3, 3, 8, 8)}, MODEL, inputs=criteria)
