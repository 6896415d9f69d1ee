import pytest
import torch

from device_agent.clients import build_program
from device_agent.clients.assignment_check import BadAssignment
from device_agent.clients.rank_one import rank_one_model
from device_agent.clients.spec import parse_spec
from device_agent.layers import rank_one_layers

MODEL = {"arch": "cnn", "num_classes": 4, "in_channels": 1, "image_size": 8}
COMMON = {"model": MODEL, "level": 1.0, "lambda_sparsity": 1e-3, "prune_below": 0.0}
FACTORIZED_FL = parse_spec({**COMMON, "strategy": "factorized_fl", "layout": "kernel", "share_head": False})
SIMFED = parse_spec({**COMMON, "strategy": "simfed", "layout": "channel"})


def full_model(layout: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return rank_one_model(FACTORIZED_FL if layout == "kernel" else SIMFED).state_dict()


def test_regularizer_is_l1_on_live_mu_with_a_gradient():
    program = build_program(FACTORIZED_FL, full_model("kernel"))
    with torch.no_grad():
        program.model.conv2.mu.fill_(0.5)
    penalty = program.regularizer()
    assert penalty is not None
    assert float(penalty.detach()) == pytest.approx(1e-3 * 0.5 * program.model.conv2.mu.numel())
    penalty.backward()
    assert torch.all(program.model.conv2.mu.grad == 1e-3)


def test_factorized_fl_keeps_everything_and_uploads_u_plus_one_v():
    program = build_program(FACTORIZED_FL, full_model("kernel"))
    assert set(program.upload()) == {"conv1.u", "conv2.u", "conv3.u", "conv3.v"}
    assert set(program.keep()) == set(program.model.state_dict())


def test_simfed_embedding_is_the_classifier_input_on_the_criteria():
    criteria = torch.randn(3, 1, 8, 8)
    tensors = {**full_model("channel"), "criteria": criteria}
    program = build_program(SIMFED, tensors)
    assert all(layer.layout == "channel" for layer in rank_one_layers(program.model).values())
    embedding = program.extras()["embedding"]
    assert embedding.shape == (3 * 128,)
    assert program.model.training  # the embedding pass left the mode alone


def test_simfed_without_criteria_is_named():
    with pytest.raises(BadAssignment, match="missing 'criteria'"):
        build_program(SIMFED, full_model("channel"))
