"""Property: an assignment's tensors that do not fit its spec make build_program raise ValueError or RuntimeError.

Those are what the agent's round handler catches (it answers round_failed): a payload from a buggy
or hostile coordinator must end the round, not the agent. Fewer examples than the decoders' fuzzers:
each builds a model. (Tensors of another dtype are cast by load_state_dict, not refused.)
"""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_agent.clients import build_program
from device_agent.clients.spec import parse_spec
from device_agent.hybrid import hybrid
from device_agent.models import build_model

FUZZ = settings(max_examples=15, suppress_health_check=[HealthCheck.too_slow])
MODEL = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8}
CASES = {
    "fedavg": ({"level": 1.0, "scaler": False, "send_classes": False}, lambda: build_model("cnn").state_dict()),
    "fedhm": ({"level": 0.5, "frobenius_decay": 1e-3}, lambda: hybrid("cnn", 0.5).state_dict()),
    "heterofl": (
        {"level": 0.5, "scaler": True, "send_classes": True},
        lambda: build_model("cnn", width=0.5).state_dict(),
    ),
}
DTYPES = [torch.float16, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64]
mutations = st.lists(
    st.tuples(
        st.sampled_from(["drop", "reshape", "dtype", "extra", "scalar", "empty"]),
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
    return tensors


@pytest.mark.parametrize("strategy", sorted(CASES))
@FUZZ
@given(mutations=mutations)
def test_tensors_that_do_not_fit_the_spec_are_refused_with_value_or_runtime_error(strategy, mutations):
    spec = parse_spec({"strategy": strategy, "model": MODEL, **CASES[strategy][0]})
    try:
        build_program(spec, _mutate(_state(strategy), mutations))
    except (ValueError, RuntimeError) as exc:
        assert str(exc)
