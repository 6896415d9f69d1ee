"""Property: build_program refuses exactly the assignments whose tensors do not fit its spec, with BadAssignment.

That is what the agent's round handler answers ``round_failed: bad_assignment`` to: a payload from a
buggy or hostile coordinator must end the round, not the agent, and is never cast to fit (no
warning from load_state_dict either). Fewer examples than the decoders' fuzzers: each builds a model.
"""

import functools
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_agent.clients import build_program
from device_agent.clients.assignment_check import BadAssignment
from device_agent.clients.base import is_norm_statistic
from device_agent.clients.spec import parse_spec
from device_agent.layers.hybrid import hybrid
from device_agent.models import build_model

FUZZ = settings(max_examples=15, suppress_health_check=[HealthCheck.too_slow])
MODEL = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8}
CASES = {
    "fedavg": ({"level": 1.0, "scaler": False, "send_classes": False}, lambda: build_model("cnn").state_dict()),
    "fedhm": ({"level": 0.5, "frobenius_decay": 1e-3, "send_classes": False}, lambda: hybrid("cnn", 0.5).state_dict()),
    "heterofl": (
        {"level": 0.5, "scaler": True, "send_classes": True},
        lambda: build_model("cnn", width=0.5).state_dict(),
    ),
}
DTYPES = [torch.float16, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64]
INTEGERS = {torch.int64, torch.uint8}
mutations = st.lists(
    st.tuples(
        st.sampled_from(["drop", "reshape", "dtype", "extra", "scalar", "empty", "nan"]),
        st.integers(0, 100),
        st.sampled_from(DTYPES),
    ),
    min_size=1,
    max_size=3,
)


@functools.cache
def _state(strategy: str) -> dict[str, torch.Tensor]:
    """A fitting assignment for ``strategy``, built once (a FedHM hybrid takes seconds on a loaded machine)."""
    return CASES[strategy][1]()


def _mutate(tensors: dict[str, torch.Tensor], mutations) -> dict[str, torch.Tensor]:
    tensors = dict(tensors)
    for kind, pick, dtype in mutations:
        name = sorted(tensors)[pick % len(tensors)] if tensors else "x"
        if kind == "drop":
            tensors.pop(name, None)
        elif kind == "reshape" and name in tensors:
            tensors[name] = torch.zeros(tensors[name].numel() + 1)
        elif kind == "dtype" and name in tensors:
            tensors[name] = tensors[name].to(dtype)
        elif kind == "extra":
            tensors[f"extra.{pick}"] = torch.zeros(2)
        elif kind == "scalar" and name in tensors:
            tensors[name] = torch.tensor(1.0)
        elif kind == "empty" and name in tensors:
            tensors[name] = torch.zeros(0)
        elif kind == "nan" and name in tensors and tensors[name].is_floating_point() and tensors[name].numel():
            tensors[name] = tensors[name].clone()
            tensors[name].view(-1)[0] = float("nan")
    return tensors


def _fits(tensors: dict[str, torch.Tensor], model: dict[str, torch.Tensor]) -> bool:
    """The model's own tensors (an integer buffer may be of any integer dtype), finite, less some BN statistics."""
    if not set(tensors) <= set(model) or not all(is_norm_statistic(key) for key in set(model) - set(tensors)):
        return False
    return all(
        t.shape == model[key].shape
        and (t.dtype == model[key].dtype or {t.dtype, model[key].dtype} <= INTEGERS)
        and (not t.is_floating_point() or bool(torch.isfinite(t).all()))
        for key, t in tensors.items()
    )


@pytest.mark.parametrize("strategy", sorted(CASES))
@FUZZ
@given(mutations=mutations)
def test_tensors_that_do_not_fit_the_spec_are_refused_and_never_cast(strategy, mutations):
    spec = parse_spec({"strategy": strategy, "model": MODEL, **CASES[strategy][0]})
    tensors = _mutate(_state(strategy), mutations)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # load_state_dict's "Casting complex values to real" among them
        try:
            build_program(spec, tensors)
        except BadAssignment as exc:
            assert not _fits(tensors, _state(strategy)), exc
            assert str(exc).startswith("assignment does not fit the model: ")
        else:
            assert _fits(tensors, _state(strategy))
