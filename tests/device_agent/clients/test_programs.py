import pytest
import torch

from device_agent.clients import build_program
from device_agent.clients.assignment_check import BadAssignment
from device_agent.clients.spec import parse_spec
from device_agent.layers.hybrid import hybrid
from device_agent.models import build_model

MODEL = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8}


def test_fedhm_program_uploads_factors_never_dense_copies():
    tensors = hybrid("cnn", 0.5).state_dict()
    spec = parse_spec(
        {"strategy": "fedhm", "model": MODEL, "level": 0.5, "frobenius_decay": 1e-3, "send_classes": False}
    )
    program = build_program(spec, tensors)
    upload = program.upload()
    assert "conv2.reduce" in upload and "conv2.weight" not in upload
    assert not any("running" in key for key in upload)
    groups = program.param_groups(5e-4)
    assert [g["weight_decay"] for g in groups] == [5e-4, 0.0]
    program.note_local_classes(torch.tensor([1, 4]))
    assert program.extras() == {}


def test_fedhm_program_reports_its_classes_when_the_server_masks_classifier_rows():
    spec = parse_spec({"strategy": "fedhm", "model": MODEL, "level": 0.5, "frobenius_decay": 0.0, "send_classes": True})
    program = build_program(spec, hybrid("cnn", 0.5).state_dict())
    program.note_local_classes(torch.tensor([0, 6, 9]))
    assert program.extras()["classes"].tolist() == [0, 6, 9]


def test_width_program_builds_the_sub_model_and_its_scaler():
    tensors = build_model("cnn", width=0.5).state_dict()
    spec = parse_spec({"strategy": "heterofl", "model": MODEL, "level": 0.5, "scaler": True, "send_classes": True})
    program = build_program(spec, tensors)
    assert program.model.conv1.weight.shape[0] == 16 and program.train_scale() == 2.0
    program.note_local_classes(torch.tensor([1, 4]))
    assert program.extras()["classes"].tolist() == [1, 4]


def test_specs_that_do_not_fit_are_named():
    with pytest.raises(ValueError, match=r"spec\.strategy: unknown strategy 'nope' \(this agent trains: .*fedhm"):
        parse_spec({"strategy": "nope", "model": MODEL, "level": 1.0})
    with pytest.raises(ValueError, match=r"spec\.level: Field required"):
        parse_spec({"strategy": "fedavg", "model": MODEL, "scaler": False, "send_classes": False})
    with pytest.raises(ValueError, match=r"spec\.frobenius_decay: Field required"):
        parse_spec({"strategy": "fedhm", "model": MODEL, "level": 0.5})
    with pytest.raises(ValueError, match=r"spec\.momentum: Extra inputs are not permitted"):
        parse_spec(
            {
                "strategy": "fedhm",
                "model": MODEL,
                "level": 0.5,
                "frobenius_decay": 0.0,
                "send_classes": False,
                "momentum": 0.9,
            }
        )
    spec = parse_spec({"strategy": "fedavg", "model": MODEL, "level": 1.0, "scaler": False, "send_classes": False})
    with pytest.raises(BadAssignment, match=r"missing 'bn1.bias', 'bn1.weight', .* and 6 more"):
        build_program(spec, {})


@pytest.mark.parametrize("level", [0.5, 1.0])
def test_a_program_holds_exactly_its_assignment_without_drawing_initial_weights(level):
    """The model is built on the meta device and filled by the assignment; norm statistics the assignment leaves
    out start as a fresh model's (zero mean, unit variance)."""
    sent = {k: v for k, v in hybrid("cnn", level).state_dict().items() if "running" not in k}
    spec = parse_spec(
        {"strategy": "fedhm", "model": MODEL, "level": level, "frobenius_decay": 0.0, "send_classes": False}
    )
    state = build_program(spec, sent).model.state_dict()
    for name, tensor in sent.items():
        assert torch.equal(state[name], tensor), name
    for name, tensor in state.items():
        if name.endswith("running_mean"):
            assert torch.equal(tensor, torch.zeros_like(tensor))
        elif name.endswith("running_var"):
            assert torch.equal(tensor, torch.ones_like(tensor))
    assert all(t.device.type == "cpu" for t in state.values())
