"""Predict what one local training step costs a device: peak memory and time.

Both predictions come from one trace of the model a device trains (cheap: built on the meta
device, run as zeros at batch sizes 1 and 2), scaled to the batch size. The caller says which
model: the coordinator traces its strategy's client model at a level (``trace_module``; the
planner caches traces by strategy, parameters, model and level), and ``trace_hybrid`` traces a
FedHM hybrid (what benchmarks/costmodel.py measures).

- memory = runtime context + weights + gradients and optimizer state of the trainable weights
  + saved tensors that do not grow with the batch (a rank-one layer's rebuilt dense weight)
  + batch x saved activations + batch x the gradients live at backward's peak, times a slack factor for the
  allocator (1 on CPU, 1.1 on GPUs). Saved activations are counted exactly, from the tensors autograd keeps
  (each storage once), so the r-channel intermediate of a factorized convolution is in, and an in-place ReLU
  output shared with the next convolution's input is counted once. Backward frees what an operator saved
  once it has run, in reverse order, so when it reaches operator k only what operators 1..k saved is still
  held, next to k's output and input gradients and the weight gradients of k and the operators after it (the
  earlier layers' are not made yet): the peak is the largest of those sums (late in the model,
  where nearly everything saved is held and the gradients are small), not everything saved plus the
  largest activation anywhere (a 28 px CNN's first conv output: 12 % too much).
- time = sum over operators of max(FLOPs / (efficiency x fp32 peak), bytes / memory bandwidth)
  + a fixed cost per launched operator (a per-operator roofline: a small factorized convolution is
  bandwidth- or overhead-bound long before it is compute-bound). A convolution whose GEMM view has
  a side below 64 (few output channels, or a short reduction: the r-channel halves of a
  factorized layer at small gamma) cannot fill the SIMD / tensor-core tiles, so its efficiency
  is scaled by sqrt(side / 64) per side (a 64 -> 8 channel 3 x 3 convolution trains at 0.36 of the
  full rate on a 2-core EPYC; side / 64 said 0.125). Training FLOPs and bytes are 3x the forward's
  (backward = 2 x forward, as FedScale and POET assume).
- On a CPU, an operator whose input or output exceeds glibc's largest mmap threshold (32 MiB) gets
  fresh mappings every step, whose pages fault in as they are written: its bytes move at the
  profile's ``fresh_memory_bandwidth_gbs`` (the probe's batch norm on a fresh 64 MiB buffer), the
  others' at ``memory_bandwidth_gbs`` (the same on a reused 16 MiB one).

``efficiency`` (the convolutions' training rate over the matmul peak) is what varies most between
device classes: the probe measures it (``training_efficiency``); benchmarks/costmodel.py checks the
whole model against timed steps with nothing fitted to them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Literal

import torch
from torch import nn

from device_agent.layers import RankOneLayer
from device_agent.layers.factorized import LowRankLayer
from device_agent.layers.hybrid import hybrid
from device_agent.layers.lora import LORA_WRAPPERS, LoRASlice
from device_agent.models import model_card
from profiles.schema import DeviceClass

Optimizer = Literal["sgd", "momentum", "adam"]
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}

# Defaults for numbers a profile may leave out (fraction of fp32 peak reached by training convs,
# fixed cost per operator, memory the runtime holds before the first step). Calibrate per device.
DEFAULT_EFFICIENCY = {"cpu": 0.5, "cuda": 0.35, "mps": 0.25}
DEFAULT_KERNEL_OVERHEAD_US = {"cpu": 10.0, "cuda": 15.0, "mps": 40.0}
RUNTIME_CONTEXT_BYTES = {"cpu": 300 * 2**20, "cuda": 600 * 2**20, "mps": 400 * 2**20}
# Allocator slack and framework workspace on top of the tensors counted. CPU: measured 1.0 with
# glibc returning freed tensors at once (benchmarks/costmodel.py); GPU: an estimate for the
# caching allocator's rounding and cuDNN workspaces.
ALLOCATOR_SLACK = {"cpu": 1.0, "cuda": 1.1, "mps": 1.1}
_FULL_TILE = 64
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: blocks above it are always mmapped, hence page-faulted.
FRESH_MAPPING_BYTES = 32 * 2**20
_TRAIN_MULTIPLIER = 3
_FP32 = 4


@dataclass(frozen=True)
class OpCost:
    """One forward operator at batch size 1: weight bytes do not scale with the batch, the rest do."""

    flops: float
    activation_bytes: float
    weight_bytes: float
    output_bytes: float = 0.0
    efficiency_scale: float = 1.0
    largest_bytes: float = 0.0  # its largest input or output tensor (a fresh mapping above FRESH_MAPPING_BYTES)
    gradient_bytes: float = 0.0  # its output's gradient and, when its input needs one, the input's
    weight_gradient_bytes: float = 0.0  # its trainable weights' gradients, made when backward reaches it


def _tile_scale(out_channels: int, reduction: int) -> float:
    return math.sqrt(min(1.0, out_channels / _FULL_TILE) * min(1.0, reduction / _FULL_TILE))


@dataclass(frozen=True)
class ModelTrace:
    """Everything the cost model needs from a model, measured once at batch size 1.

    ``params`` counts every weight (held in memory); ``trainable_params`` only those with
    ``requires_grad`` (they alone get gradients and optimizer state: frozen weights, as under
    LoRA, cost their storage only).
    """

    params: int
    trainable_params: int
    buffer_bytes: int
    param_tensors: int
    saved_bytes_per_sample: int
    saved_fixed_bytes: int
    transient_bytes_per_sample: int  # per sample, held at backward's peak beyond the saved activations
    ops: tuple[OpCost, ...]
    backward: tuple[tuple[int, int], ...] = ()
    """Per operator, as backward reaches it: (bytes per sample held: what it and earlier operators saved, and its
    gradients; weight-gradient bytes made so far: its own, later operators' and any weight no operator claimed)."""

    @property
    def forward_flops_per_sample(self) -> float:
        return sum(op.flops for op in self.ops)


@dataclass(frozen=True)
class MemoryEstimate:
    runtime: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    transient: int
    total: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _op_cost(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> OpCost | None:
    x = inputs[0]
    io_bytes = float((x.numel() + output.numel()) * _FP32)
    out_bytes = float(output.numel() * _FP32)
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        reduction = module.in_channels // module.groups * kh * kw
        flops = 2.0 * output.numel() * reduction
        scale = _tile_scale(module.out_channels, reduction)
        return OpCost(flops, io_bytes, float(module.weight.numel() * _FP32), out_bytes, scale)
    if isinstance(module, nn.Linear):
        flops = 2.0 * output.numel() * module.in_features
        return OpCost(flops, io_bytes, float(module.weight.numel() * _FP32), out_bytes)
    if isinstance(module, LORA_WRAPPERS):
        # The bypass x -> r -> out only: the frozen base is a leaf module of its own (costed as a
        # Linear, read but never updated). Only A and B get gradients. A fused_qkv slice reads its
        # rows of the shared B (A is counted once per slice: it is read by each).
        adapter = module.adapter if isinstance(module, LoRASlice) else module
        tokens = output.numel() // module.out_features
        flops = 2.0 * tokens * adapter.rank * (module.in_features + module.out_features)
        weights = adapter.reduce.numel() + adapter.rank * module.out_features
        return OpCost(flops, io_bytes, float(weights * _FP32), out_bytes)
    if isinstance(module, nn.LayerNorm | nn.GELU):
        return OpCost(0.0, io_bytes, 0.0, out_bytes)
    if isinstance(module, RankOneLayer):
        # A conv / linear whose weight pi(u v^T + mu) is rebuilt every step: u, v and mu are read and
        # the dense weight written (weight bytes, not scaled by the batch), then the layer runs as usual.
        shape = module.weight_shape
        reduction = math.prod(shape[1:])
        dense = math.prod(shape)
        weight_bytes = float((module.u.numel() + module.v.numel() + module.mu.numel() + 2 * dense) * _FP32)
        flops = 2.0 * output.numel() * reduction + 2.0 * dense
        scale = _tile_scale(shape[0], reduction) if len(shape) == 4 else 1.0
        return OpCost(flops, io_bytes, weight_bytes, out_bytes, scale)
    if isinstance(module, nn.BatchNorm2d):
        # Training-mode BN reads its input twice (statistics, then normalize) and writes once.
        return OpCost(0.0, io_bytes + x.numel() * _FP32, 0.0, out_bytes)
    if isinstance(module, nn.ReLU | nn.MaxPool2d | nn.AdaptiveAvgPool2d):
        return OpCost(0.0, io_bytes, 0.0, out_bytes)
    return None


def trace_module(model: nn.Module, in_channels: int, image_size: int) -> ModelTrace:
    """Trace one training-mode forward pass of ``model`` at batch 1 on the CPU: operators and saved tensors.

    Build ``model`` on the meta device: it is materialized here as zeros, in place (shapes are all
    that matter, and skipping initialization, e.g. FedHM's spectral one, keeps a trace in the tens
    of milliseconds). Its values, if it had any, are discarded.
    """
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ops: list[OpCost] = []
    claimed: set[int] = set()

    def weight_gradients(module: nn.Module) -> float:
        """Bytes of the gradients of ``module``'s trainable weights no operator claimed yet (a wrapper's
        children run, and claim theirs, first)."""
        mine = [p for p in module.parameters() if p.requires_grad and id(p) not in claimed]
        claimed.update(id(p) for p in mine)
        return float(sum(p.numel() for p in mine) * _FP32)

    def leaf_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        cost = _op_cost(module, inputs, output)
        if cost is not None:
            largest = float(max(inputs[0].numel(), output.numel()) * _FP32)
            gradients = _gradient_bytes(inputs[0], output.numel())
            ops.append(
                replace(
                    cost,
                    largest_bytes=largest,
                    gradient_bytes=gradients,
                    weight_gradient_bytes=weight_gradients(module),
                )
            )

    def lowrank_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        # reduce: C_in -> r over (1 x k); expand: r -> C_out over (k x 1); the r-channel map sits between.
        x, reduce, expand = inputs[0], module.reduce, module.expand
        r, out_channels = reduce.shape[0], expand.shape[0]
        mid = x.shape[0] * r * (x.shape[2] * output.shape[3] if reduce.dim() == 4 else 1)
        reduce_k, expand_k = reduce[0].numel(), expand[0].numel()
        ops.append(
            OpCost(
                2.0 * mid * reduce_k,
                float((x.numel() + mid) * _FP32),
                float(reduce.numel() * _FP32),
                float(mid * _FP32),
                _tile_scale(r, reduce_k),
                float(max(x.numel(), mid) * _FP32),
                _gradient_bytes(x, mid),
            )
        )
        ops.append(
            OpCost(
                2.0 * output.numel() * expand_k,
                float((mid + output.numel()) * _FP32),
                float(expand.numel() * _FP32),
                float(output.numel() * _FP32),
                _tile_scale(out_channels, expand_k),
                float(max(mid, output.numel()) * _FP32),
                float((mid + output.numel()) * _FP32),
                weight_gradients(module),  # backward reaches the expand half first
            )
        )

    handles = []
    for module in model.modules():
        if isinstance(module, LowRankLayer):
            handles.append(module.register_forward_hook(lowrank_hook))
        elif isinstance(module, LORA_WRAPPERS) or not list(module.children()):
            handles.append(module.register_forward_hook(leaf_hook))

    def saved_bytes(batch: int) -> list[int]:
        """Bytes saved for backward by each operator (index into ``ops``; each storage at its first saver)."""
        saved: dict[int, tuple[int, int]] = {}
        ops.clear()
        claimed.clear()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in param_ptrs and storage.data_ptr() not in saved:
                saved[storage.data_ptr()] = (len(ops), storage.nbytes())  # saved while ops[len(ops)] runs
            return tensor

        x = torch.zeros(batch, in_channels, image_size, image_size)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = model(x)
        del output
        by_op = [0] * (len(ops) + 1)
        for position, nbytes in saved.values():
            by_op[min(position, len(ops))] += nbytes
        return by_op

    two = saved_bytes(2)
    one = saved_bytes(1)
    for handle in handles:
        handle.remove()
    # The pass at batch 2 splits what is saved into per-sample activations and what does not grow with
    # the batch (e.g. the dense weight a rank-one layer rebuilds every step).
    per_op = [b - a for a, b in zip(one, two, strict=True)]
    per_sample, fixed = sum(per_op), sum(one) - sum(per_op)
    # What backward holds as it reaches each operator: what it and earlier operators saved (later ones' is
    # freed), its gradients, and the weight gradients of it and the operators after it (made already).
    unclaimed = sum(p.numel() * _FP32 for p in params if id(p) not in claimed)
    made = [0.0] * (len(ops) + 1)
    for k in range(len(ops) - 1, -1, -1):
        made[k] = made[k + 1] + ops[k].weight_gradient_bytes
    held = 0
    peak = 0.0
    backward = []
    for k, (op, saved) in enumerate(zip(ops, per_op, strict=False)):
        held += saved
        peak = max(peak, held + op.gradient_bytes)
        backward.append((int(held + op.gradient_bytes), int(made[k] + unclaimed)))
    return ModelTrace(
        params=sum(p.numel() for p in model.parameters()),
        trainable_params=sum(p.numel() for p in params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        param_tensors=len(params),
        saved_bytes_per_sample=per_sample,
        saved_fixed_bytes=fixed,
        transient_bytes_per_sample=max(0, int(peak) - per_sample),
        ops=tuple(ops),
        backward=tuple(backward),
    )


def _gradient_bytes(x: torch.Tensor, output_numel: int) -> float:
    """Bytes of an operator's gradients in backward: its output's, and its input's unless nothing needs it."""
    return float((output_numel + (x.numel() if x.requires_grad else 0)) * _FP32)


@lru_cache(maxsize=64)
def trace_hybrid(
    arch: str, gamma: float, num_classes: int = 10, in_channels: int | None = None, image_size: int | None = None
) -> ModelTrace:
    """The trace of the FedHM hybrid ``hybrid(arch, gamma)`` (cached): what benchmarks/costmodel.py measures."""
    card = model_card(arch)
    channels = in_channels or card.in_channels
    with torch.device("meta"):
        model = hybrid(arch, gamma, num_classes, channels)
    return trace_module(model, channels, image_size or card.image_size)


@dataclass(frozen=True)
class Workload:
    """One local training step: the traced model, on how many samples, with which optimizer."""

    trace: ModelTrace
    batch_size: int
    optimizer: Optimizer = "momentum"


def hybrid_workload(
    arch: str,
    gamma: float,
    batch_size: int,
    optimizer: Optimizer = "momentum",
    num_classes: int = 10,
    in_channels: int | None = None,
    image_size: int | None = None,
) -> Workload:
    """A training step of the FedHM hybrid at rank ratio ``gamma``."""
    return Workload(trace_hybrid(arch, gamma, num_classes, in_channels, image_size), batch_size, optimizer)


def predict_memory(work: Workload, accelerator: str = "cpu", include_runtime: bool = True) -> MemoryEstimate:
    """Peak bytes of one training step (``include_runtime=False``: the step alone, without the torch context)."""
    if work.optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {work.optimizer!r}; choose one of: {', '.join(OPTIMIZER_STATES)}")
    trace = work.trace
    weights = trace.params * _FP32 + trace.buffer_bytes
    gradients = trace.trainable_params * _FP32
    optimizer = trace.trainable_params * _FP32 * OPTIMIZER_STATES[work.optimizer]
    activations = trace.saved_fixed_bytes + trace.saved_bytes_per_sample * work.batch_size
    transient = trace.transient_bytes_per_sample * work.batch_size
    if trace.backward:
        # The peak of backward's walk: the gradients of weights it has not reached yet do not exist, so
        # ``transient`` (the peak beyond the saved activations and every gradient) can be below zero.
        peak = max(held * work.batch_size + made for held, made in trace.backward)
        transient = trace.saved_fixed_bytes + peak - activations - gradients
    runtime = RUNTIME_CONTEXT_BYTES[accelerator] if include_runtime else 0
    counted = weights + gradients + optimizer + activations + transient
    total = runtime + math.ceil(counted * ALLOCATOR_SLACK[accelerator])
    return MemoryEstimate(runtime, weights, gradients, optimizer, activations, transient, total)


AGENT_BASELINE_BYTES = {"cpu": 437 * 2**20, "cuda": 437 * 2**20 + RUNTIME_CONTEXT_BYTES["cuda"], "mps": 837 * 2**20}
"""Peak RSS of an idle agent process: Python, torch, the agent's modules, its MQTT session threads and
the start-up probe, before any round. cpu: the VmHWM of an idle ``device-agent run`` on the 2-core CI
box (x86-64, torch 2.13 CPU wheel), 436.6 MiB, measured by ``python -m benchmarks.emulation --memory``
(``idle_agent_vmhwm_mib``; re-measure there on another platform). cuda and mps add the accelerator
context on top: estimates."""

PROCESS_ACTIVATION_FACTOR = {"cpu": 1.5, "cuda": 1.0, "mps": 1.0}
"""Resident bytes of a training step's activations over the traced ones. On CPU backward keeps the
activations' gradients next to the saved tensors and the allocator does not hand freed blocks back
at once: fitted, with :data:`INFERENCE_LIVE_FRACTION`, to the agent processes' VmHWM of
``benchmarks/process_peak.py`` (CNN and ResNet-18 at 32 px, batch 16/32/64, gamma 1 and 1/4; all
eight within 8 % on the CI box). GPUs: the traced bytes, their allocator slack is ALLOCATOR_SLACK."""

INFERENCE_LIVE_FRACTION = 0.2
"""Part of a batch's saved activations alive at once in a no-grad pass (the agent's BatchNorm
calibration and local evaluation, up to :data:`INFERENCE_BATCH` samples at a time); fitted as above."""

INFERENCE_BATCH = 256


@dataclass(frozen=True)
class ProcessPeak:
    """Peak memory of an agent process over a whole round, by what holds it."""

    baseline: int
    data: int
    model_copies: int
    step: int
    inference: int
    total: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def dataset_bytes(samples: int, in_channels: int, image_size: int) -> int:
    """Bytes of ``samples`` images at the model's input shape as float32, with their int64 labels."""
    return samples * (in_channels * image_size * image_size * _FP32 + 8)


def predict_process_peak(
    work: Workload, accelerator: str, *, download_bytes: int, upload_bytes: int, data_bytes: int, samples: int
) -> ProcessPeak:
    """Peak memory of the agent process over a round, not only the training step.

    The agent holds, at its peak: its runtime (:data:`AGENT_BASELINE_BYTES`); its data (``data_bytes``:
    the data set it loads at the model's input shape and its own share, see :func:`dataset_bytes`); the
    model several times over (the downloaded payload and its decoded tensors, the model it trains,
    the packed upload and its serialized copy in the outbox); the training step's gradients,
    optimizer state and activations (:data:`PROCESS_ACTIVATION_FACTOR`); and the no-grad passes over
    its ``samples`` after training (BatchNorm calibration, local evaluation).
    """
    step = predict_memory(work, accelerator, include_runtime=False)
    copies = 2 * download_bytes + step.weights + 2 * upload_bytes
    activations = (step.activations + max(step.transient, 0)) * PROCESS_ACTIVATION_FACTOR[accelerator]
    training = step.gradients + step.optimizer + math.ceil(activations * ALLOCATOR_SLACK[accelerator])
    trace = work.trace
    inference = math.ceil(INFERENCE_LIVE_FRACTION * trace.saved_bytes_per_sample * min(INFERENCE_BATCH, samples))
    baseline = AGENT_BASELINE_BYTES[accelerator]
    total = baseline + data_bytes + copies + training + inference
    return ProcessPeak(baseline, data_bytes, copies, training, inference, total)


def predict_step_seconds(work: Workload, profile: DeviceClass, efficiency: float | None = None) -> float:
    """Seconds of one training step (forward, backward, optimizer) on ``profile``."""
    trace = work.trace
    compute = profile.compute
    eff = efficiency or compute.training_efficiency or DEFAULT_EFFICIENCY[profile.accelerator]
    overhead = compute.kernel_overhead_us
    overhead = DEFAULT_KERNEL_OVERHEAD_US[profile.accelerator] if overhead is None else overhead
    flop_rate = eff * compute.fp32_gflops * 1e9
    byte_rate = (compute.memory_bandwidth_gbs or math.inf) * 1e9
    fresh = compute.fresh_memory_bandwidth_gbs if profile.accelerator == "cpu" else None
    fresh_rate = fresh * 1e9 if fresh else byte_rate
    seconds = 0.0
    for op in trace.ops:
        flops = op.flops * work.batch_size * _TRAIN_MULTIPLIER
        moved = (op.activation_bytes * work.batch_size + op.weight_bytes) * _TRAIN_MULTIPLIER
        rate = fresh_rate if op.largest_bytes * work.batch_size >= FRESH_MAPPING_BYTES else byte_rate
        seconds += max(flops / (flop_rate * op.efficiency_scale), moved / rate)
    # Optimizer: reads weight, grad and each state, writes weight and states.
    optimizer_bytes = trace.trainable_params * _FP32 * (3 + 2 * OPTIMIZER_STATES[work.optimizer])
    seconds += optimizer_bytes / byte_rate
    kernels = _TRAIN_MULTIPLIER * len(trace.ops) + trace.param_tensors
    return seconds + kernels * overhead * 1e-6


def calibrate_efficiency(work: Workload, profile: DeviceClass, measured_seconds: float) -> float:
    """The efficiency at which ``predict_step_seconds`` equals a measured step (bisection; clamped to (0, 4])."""
    low, high = 1e-4, 4.0
    if predict_step_seconds(work, profile, high) >= measured_seconds:
        return high
    for _ in range(60):
        mid = math.sqrt(low * high)
        if predict_step_seconds(work, profile, mid) > measured_seconds:
            low = mid
        else:
            high = mid
    return high
