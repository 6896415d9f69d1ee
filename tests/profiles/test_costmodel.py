"""The cost model's rules, checked against the model zoo rather than against fixed numbers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from coordinator.planning.model_stats import model_stats
from device_agent.layers import rank_one_layers, reparametrize
from device_agent.models import build_model
from profiles.catalog import load_catalog
from profiles.costmodel import (
    AGENT_BASELINE_BYTES,
    OPTIMIZER_STATES,
    Workload,
    calibrate_efficiency,
    dataset_bytes,
    hybrid_workload,
    predict_memory,
    predict_process_peak,
    predict_step_seconds,
    trace_hybrid,
    trace_module,
)
from profiles.schema import DeviceClass

GAMMAS = (1.0, 0.5, 0.25, 0.125)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_weights_gradients_and_optimizer_state_follow_the_parameter_count(gamma: float) -> None:
    params = model_stats("resnet18", gamma).params

    for optimizer, states in OPTIMIZER_STATES.items():
        estimate = predict_memory(hybrid_workload("resnet18", gamma, 16, optimizer))
        assert estimate.gradients == 4 * params
        assert estimate.optimizer == 4 * params * states
        assert estimate.weights >= 4 * params  # plus BatchNorm running statistics


def test_lowering_the_rank_cuts_parameters_but_barely_activations() -> None:
    full = predict_memory(hybrid_workload("resnet18", 1.0, 32))
    small = predict_memory(hybrid_workload("resnet18", 0.125, 32))

    assert small.weights / full.weights < 0.15
    # The r-channel intermediate of every factorized conv is saved too: activations do not shrink.
    assert small.activations >= 0.9 * full.activations


def test_activation_memory_is_linear_in_the_batch_size() -> None:
    one = predict_memory(hybrid_workload("cnn", 0.5, 1, image_size=32), include_runtime=False)
    many = predict_memory(hybrid_workload("cnn", 0.5, 65, image_size=32), include_runtime=False)
    per_sample = trace_hybrid("cnn", 0.5, image_size=32)

    grown = many.total - one.total
    assert grown == 64 * (per_sample.saved_bytes_per_sample + per_sample.transient_bytes_per_sample)


def test_saved_activations_count_each_storage_once() -> None:
    trace = trace_hybrid("cnn", 1.0, image_size=8)
    # conv1 input, and per conv-BN-ReLU stage the conv output (BN input) and the in-place ReLU output.
    # Upper bound: every leaf operator's input and output saved separately.
    naive = sum(op.activation_bytes for op in trace.ops)

    assert 0 < trace.saved_bytes_per_sample < naive


def test_gpu_predictions_include_the_runtime_context() -> None:
    work = hybrid_workload("resnet18", 0.5, 8)

    assert (
        predict_memory(work, "cuda").total
        > predict_memory(work, "cpu").total
        > predict_memory(work, "cpu", include_runtime=False).total
    )


def test_step_time_grows_with_batch_and_shrinks_with_rank() -> None:
    pi = load_catalog()["raspberry-pi-5"]

    times = [predict_step_seconds(hybrid_workload("resnet18", g, 32), pi) for g in GAMMAS]
    assert times == sorted(times, reverse=True)
    assert predict_step_seconds(hybrid_workload("resnet18", 0.5, 64), pi) > predict_step_seconds(
        hybrid_workload("resnet18", 0.5, 32), pi
    )


def test_faster_devices_are_predicted_faster() -> None:
    catalog = load_catalog()
    work = hybrid_workload("resnet18", 1.0, 32)

    assert predict_step_seconds(work, catalog["rtx-3060-laptop"]) < predict_step_seconds(work, catalog["jetson-nano"])
    assert predict_step_seconds(work, catalog["jetson-nano"]) < predict_step_seconds(work, catalog["raspberry-pi-4"])


def test_calibration_recovers_the_efficiency_that_produced_a_time() -> None:
    pi = load_catalog()["raspberry-pi-5"]
    work = hybrid_workload("resnet18", 1.0, 16)
    measured = predict_step_seconds(work, pi, efficiency=0.21)

    assert calibrate_efficiency(work, pi, measured) == pytest.approx(0.21, rel=1e-3)


def test_an_unknown_optimizer_is_named() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'lbfgs'"):
        predict_memory(hybrid_workload("cnn", 1.0, 8, "lbfgs"))  # type: ignore[arg-type]


def test_the_hybrid_trace_counts_the_parameters_of_the_model_statistics() -> None:
    trace = trace_hybrid("resnet18", 0.25)

    assert trace.params == trace.trainable_params == model_stats("resnet18", 0.25).params


def test_frozen_weights_cost_storage_but_no_gradients_or_optimizer_state() -> None:
    with torch.device("meta"):
        model = build_model("cnn", 10, 1)
    frozen = model.get_submodule(_first_conv(model))
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)
    trace = trace_module(model, 1, 8)
    frozen_count = sum(p.numel() for p in frozen.parameters())

    estimate = predict_memory(Workload(trace, 4, "adam"), include_runtime=False)

    assert trace.trainable_params == trace.params - frozen_count
    assert estimate.weights >= 4 * trace.params
    assert estimate.gradients == 4 * trace.trainable_params
    assert estimate.optimizer == 8 * trace.trainable_params


def test_a_rank_one_model_saves_its_rebuilt_weights_once_per_step_not_per_sample() -> None:
    with torch.device("meta"):
        model = reparametrize(build_model("cnn", 10, 1))
    dense_weights = sum(math.prod(layer.weight_shape) for layer in rank_one_layers(model).values())
    trace = trace_module(model, 1, 8)

    one = predict_memory(Workload(trace, 1), include_runtime=False)
    many = predict_memory(Workload(trace, 9), include_runtime=False)

    assert trace.saved_fixed_bytes >= 4 * dense_weights
    assert many.activations - one.activations == 8 * trace.saved_bytes_per_sample
    assert trace.forward_flops_per_sample > 0


def _first_conv(model: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if isinstance(m, nn.Conv2d))


def test_the_process_peak_adds_the_runtime_data_and_model_copies_to_the_step() -> None:
    work = hybrid_workload("resnet18", 1.0, 32, in_channels=3, image_size=32)
    step = predict_memory(work, "cpu", include_runtime=False)
    data = dataset_bytes(1000, 3, 32)
    peak = predict_process_peak(work, "cpu", download_bytes=10**6, upload_bytes=10**6, data_bytes=data, samples=500)
    assert data == 1000 * (3 * 32 * 32 * 4 + 8)
    assert peak.total == peak.baseline + peak.data + peak.model_copies + peak.step + peak.inference
    assert peak.baseline == AGENT_BASELINE_BYTES["cpu"] and peak.data == data
    assert peak.model_copies == 4 * 10**6 + step.weights
    assert peak.total > predict_memory(work, "cpu").total  # the step alone under-predicts the process
    bigger = predict_process_peak(
        hybrid_workload("resnet18", 1.0, 64, in_channels=3, image_size=32),
        "cpu",
        download_bytes=10**6,
        upload_bytes=10**6,
        data_bytes=data,
        samples=500,
    )
    assert bigger.step > peak.step and bigger.inference == peak.inference


def _with_fresh_bandwidth(profile: DeviceClass, gbs: float) -> DeviceClass:
    compute = profile.compute.model_copy(update={"fresh_memory_bandwidth_gbs": gbs})
    return profile.model_copy(update={"compute": compute})


def test_only_tensors_over_the_mmap_threshold_move_at_the_fresh_mapping_bandwidth_on_a_cpu() -> None:
    catalog = load_catalog()
    cpu = catalog["x86-laptop-cpu"]
    slow_fresh = _with_fresh_bandwidth(cpu, cpu.compute.memory_bandwidth_gbs / 4)
    small, large = hybrid_workload("cnn", 1.0, 8, image_size=32), hybrid_workload("cnn", 1.0, 256, image_size=32)

    # Batch 8: no tensor reaches 32 MiB, so the page-faulting bandwidth changes nothing ...
    assert predict_step_seconds(small, slow_fresh) == predict_step_seconds(small, cpu)
    # ... batch 256's 32 MiB activations (32 channels x 32 x 32 x 256 floats) are fresh mappings every step.
    assert predict_step_seconds(large, slow_fresh) > predict_step_seconds(large, cpu)
    # A GPU's caching allocator reuses its blocks: the figure is a CPU's only.
    gpu = catalog["rtx-3060-laptop"]
    assert predict_step_seconds(large, _with_fresh_bandwidth(gpu, 1.0)) == predict_step_seconds(large, gpu)


def test_a_probed_efficiency_above_one_speeds_the_convolutions_up() -> None:
    cpu = load_catalog()["x86-laptop-cpu"]
    work = hybrid_workload("resnet18", 1.0, 32)

    assert predict_step_seconds(work, cpu, efficiency=1.2) < predict_step_seconds(work, cpu, efficiency=1.0)


def test_backward_peak_holds_everything_saved_but_only_the_weight_gradients_it_has_made() -> None:
    """At backward's peak (late in ResNet-9) every saved activation is still held, but the early layers'
    weight gradients are not made yet: the step needs less than everything at once, and at least the saved."""
    work = hybrid_workload("resnet9", 1.0, 16)
    step = predict_memory(work, include_runtime=False)
    everything_at_once = step.weights + step.gradients + step.optimizer + step.activations
    first_conv = work.trace.ops[0].weight_gradient_bytes

    assert first_conv > 0
    assert step.total <= everything_at_once - first_conv
    assert step.total >= step.weights + step.optimizer + step.activations
