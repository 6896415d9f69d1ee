"""Federated evaluation: a device measures the model it received before it trains, and leaves it untouched."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.clients import build_program
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from device_agent.training.federated_evaluation import evaluate_received
from device_agent.training.local_round import train_assignment
from device_agent.training.optimizer import calibrate_batchnorm
from device_agent.wire.protocol import parse_upload_meta, upload_meta

CNN = ModelSpec("cnn", 10, 1, 8)


def received_assignment():
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    return strategy.configure(1, [ClientSlot("pi", 1.0, 100)])["pi"]


def test_the_received_model_is_measured_after_static_bn_on_the_training_shard() -> None:
    data = load_dataset("digits", 8, 1)
    assignment = received_assignment()
    program = build_program(assignment.spec, assignment.tensors)
    before = {k: v.clone() for k, v in program.model.state_dict().items()}

    report = evaluate_received(program, (data.test_x, data.test_y), data.train_x[:256])

    assert report is not None and report.samples == len(data.test_y)
    for key, value in program.model.state_dict().items():  # weights and BN buffers as received
        assert torch.equal(value, before[key]), key
    assert all(m.momentum == 0.1 for m in program.model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    reference = build_program(assignment.spec, assignment.tensors).model
    calibrate_batchnorm(reference, data.train_x[:256])
    with torch.no_grad():
        logits = reference(data.test_x)
    assert report.accuracy == float((logits.argmax(1) == data.test_y).float().mean())
    assert abs(report.loss - float(F.cross_entropy(logits, data.test_y))) < 1e-4


def test_a_device_without_a_test_shard_reports_no_federated_figures() -> None:
    data = load_dataset("digits", 8, 1)
    assignment = received_assignment()
    program = build_program(assignment.spec, assignment.tensors)

    assert evaluate_received(program, (data.test_x[:0], data.test_y[:0]), data.train_x[:64]) is None


def test_a_round_reports_the_received_model_next_to_the_trained_one_in_its_upload_meta() -> None:
    data = load_dataset("digits", 8, 1)
    assignment = received_assignment()
    shard, test = (data.train_x[:300], data.train_y[:300]), (data.test_x[:120], data.test_y[:120])

    trained = train_assignment(assignment.spec, TrainConfig(epochs=2), assignment.tensors, None, shard, test)
    meta = upload_meta(
        trained.result.samples, 1.0, trained.result.mean_loss, trained.local_accuracy, None, trained.received
    )
    parsed = parse_upload_meta(meta)

    assert parsed.received is not None and parsed.received.samples == 120
    assert parsed.received.accuracy < 0.5 < parsed.local_accuracy  # an untrained model, then a trained one
    assert parsed.received.loss > 0
