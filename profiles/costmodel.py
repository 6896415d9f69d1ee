"""Predict what one local training step costs a device: peak memory and time.

Both predictions come from one trace of the hybrid model at batch size 1 (cheap, cached), scaled
to the batch size:

- memory = runtime context + weights + gradients + optimizer state + batch x saved activations
  + batch x transient buffers of the backward pass, times a slack factor for the allocator. Saved
  activations are counted exactly, from the tensors autograd keeps (each storage once), so the
  r-channel intermediate of a factorized convolution is in, and an in-place ReLU output shared
  with the next convolution's input is counted once.
- time = sum over operators of max(FLOPs / (efficiency x fp32 peak), bytes / memory bandwidth)
  + a fixed cost per launched operator (a per-operator roofline: a small factorized convolution is
  bandwidth- or overhead-bound long before it is compute-bound). Training FLOPs and bytes are 3x
  the forward's (backward = 2 x forward, as FedScale and POET assume).

``efficiency`` is the one number to calibrate per device class (see benchmarks/costmodel.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Literal

import torch
from torch import nn

from device_agent.hybrid import hybrid
from device_agent.models import model_card
from profiles.schema import DeviceClass

Optimizer = Literal["sgd", "momentum", "adam"]
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}

# Defaults for numbers a profile may leave out (fraction of fp32 peak reached by training convs,
# fixed cost per operator, memory the runtime holds before the first step). Calibrate per device.
DEFAULT_EFFICIENCY = {"cpu": 0.5, "cuda": 0.35, "mps": 0.25}
DEFAULT_KERNEL_OVERHEAD_US = {"cpu": 10.0, "cuda": 15.0, "mps": 40.0}
RUNTIME_CONTEXT_BYTES = {"cpu": 300 * 2**20, "cuda": 600 * 2**20, "mps": 400 * 2**20}
# Allocator slack and framework workspace on top of the tensors counted.
ALLOCATOR_SLACK = 1.10
_TRAIN_MULTIPLIER = 3
_FP32 = 4


@dataclass(frozen=True)
class OpCost:
    """One forward operator at batch size 1: weight bytes do not scale with the batch, the rest do."""

    flops: float
    activation_bytes: float
    weight_bytes: float


@dataclass(frozen=True)
class ModelTrace:
    """Everything the cost model needs from a model, measured once at batch size 1."""

    params: int
    buffer_bytes: int
    param_tensors: int
    saved_bytes_per_sample: int
    transient_bytes_per_sample: int
    ops: tuple[OpCost, ...]

    @property
    def forward_flops_per_sample(self) -> float:
        return sum(op.flops for op in self.ops)

    @property
    def download_bytes(self) -> int:
        """What the device receives each round: every weight and buffer in fp32."""
        return self.params * _FP32 + self.buffer_bytes

    @property
    def upload_bytes(self) -> int:
        """What a FedHM device sends back: its trainable tensors in fp32."""
        return self.params * _FP32


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
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        flops = 2.0 * output.numel() * (module.in_channels // module.groups) * kh * kw
        return OpCost(flops, io_bytes, float(module.weight.numel() * _FP32))
    if isinstance(module, nn.Linear):
        return OpCost(2.0 * output.numel() * module.in_features, io_bytes, float(module.weight.numel() * _FP32))
    if isinstance(module, nn.BatchNorm2d):
        # Training-mode BN reads its input twice (statistics, then normalize) and writes once.
        return OpCost(0.0, io_bytes + x.numel() * _FP32, 0.0)
    if isinstance(module, nn.ReLU | nn.MaxPool2d | nn.AdaptiveAvgPool2d):
        return OpCost(0.0, io_bytes, 0.0)
    return None


def _functional_convs(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Factorized layers call F.conv2d twice; expose both as operators through their factors."""
    return [(name, tuple(p.shape)) for name, p in module.named_parameters(recurse=False) if p.dim() == 4]


@lru_cache(maxsize=64)
def trace_model(
    arch: str, gamma: float, num_classes: int = 10, in_channels: int | None = None, image_size: int | None = None
) -> ModelTrace:
    """Trace ``hybrid(arch, gamma)`` once at batch 1 on the CPU (a forward and backward of one sample)."""
    card = model_card(arch)
    channels = in_channels or card.in_channels
    size = image_size or card.image_size
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = hybrid(arch, gamma, num_classes, channels)
    finally:
        torch.random.set_rng_state(state)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ops: list[OpCost] = []

    def leaf_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        cost = _op_cost(module, inputs, output)
        if cost is not None:
            ops.append(cost)

    def lowrank_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        # reduce: C_in -> r over (1 x k); expand: r -> C_out over (k x 1); the r-channel map sits between.
        reduce, expand = module.reduce, module.expand
        r = reduce.shape[0]
        mid = output.numel() // output.shape[1] * r * (module.stride if hasattr(module, "stride") else 1)
        if reduce.dim() == 4:
            x = inputs[0]
            mid = x.shape[0] * r * x.shape[2] * output.shape[3]
            ops.append(OpCost(2.0 * mid * reduce[0].numel(), float((x.numel() + mid) * _FP32), reduce.numel() * 4.0))
            ops.append(
                OpCost(
                    2.0 * output.numel() * expand[0].numel(),
                    float((mid + output.numel()) * _FP32),
                    expand.numel() * 4.0,
                )
            )
        else:
            x = inputs[0]
            mid = x.shape[0] * r
            ops.append(OpCost(2.0 * mid * reduce.shape[1], float((x.numel() + mid) * _FP32), reduce.numel() * 4.0))
            ops.append(OpCost(2.0 * output.numel() * r, float((mid + output.numel()) * _FP32), expand.numel() * 4.0))

    handles = []
    for module in model.modules():
        if hasattr(module, "reduce") and hasattr(module, "expand"):
            handles.append(module.register_forward_hook(lowrank_hook))
        elif not list(module.children()):
            handles.append(module.register_forward_hook(leaf_hook))

    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = torch.zeros(1, channels, size, size)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = model(x)
    for handle in handles:
        handle.remove()
    largest = max(op.activation_bytes for op in ops)
    output.sum().backward()
    return ModelTrace(
        params=sum(p.numel() for p in params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        param_tensors=len(params),
        saved_bytes_per_sample=sum(saved.values()),
        # Backward holds an operator's output gradient and input gradient at once, next to what is saved.
        transient_bytes_per_sample=int(largest),
        ops=tuple(ops),
    )


@dataclass(frozen=True)
class Workload:
    """One local training step: what is trained, on how many samples, with which optimizer."""

    arch: str
    gamma: float
    batch_size: int
    optimizer: Optimizer = "momentum"
    num_classes: int = 10
    in_channels: int | None = None
    image_size: int | None = None

    def trace(self) -> ModelTrace:
        return trace_model(self.arch, self.gamma, self.num_classes, self.in_channels, self.image_size)


def predict_memory(work: Workload, accelerator: str = "cpu", include_runtime: bool = True) -> MemoryEstimate:
    """Peak bytes of one training step (``include_runtime=False``: the step alone, without the torch context)."""
    if work.optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {work.optimizer!r}; choose one of: {', '.join(OPTIMIZER_STATES)}")
    trace = work.trace()
    weights = trace.params * _FP32 + trace.buffer_bytes
    gradients = trace.params * _FP32
    optimizer = trace.params * _FP32 * OPTIMIZER_STATES[work.optimizer]
    activations = trace.saved_bytes_per_sample * work.batch_size
    transient = trace.transient_bytes_per_sample * work.batch_size
    runtime = RUNTIME_CONTEXT_BYTES[accelerator] if include_runtime else 0
    counted = weights + gradients + optimizer + activations + transient
    total = runtime + math.ceil(counted * ALLOCATOR_SLACK)
    return MemoryEstimate(runtime, weights, gradients, optimizer, activations, transient, total)


def predict_step_seconds(work: Workload, profile: DeviceClass, efficiency: float | None = None) -> float:
    """Seconds of one training step (forward, backward, optimizer) on ``profile``."""
    trace = work.trace()
    compute = profile.compute
    eff = efficiency or compute.training_efficiency or DEFAULT_EFFICIENCY[profile.accelerator]
    overhead = compute.kernel_overhead_us
    overhead = DEFAULT_KERNEL_OVERHEAD_US[profile.accelerator] if overhead is None else overhead
    flop_rate = eff * compute.fp32_gflops * 1e9
    byte_rate = (compute.memory_bandwidth_gbs or math.inf) * 1e9
    seconds = 0.0
    for op in trace.ops:
        flops = op.flops * work.batch_size * _TRAIN_MULTIPLIER
        moved = (op.activation_bytes * work.batch_size + op.weight_bytes) * _TRAIN_MULTIPLIER
        seconds += max(flops / flop_rate, moved / byte_rate)
    # Optimizer: reads weight, grad and each state, writes weight and states.
    optimizer_bytes = trace.params * _FP32 * (3 + 2 * OPTIMIZER_STATES[work.optimizer])
    seconds += optimizer_bytes / byte_rate
    kernels = _TRAIN_MULTIPLIER * len(trace.ops) + trace.param_tensors
    return seconds + kernels * overhead * 1e-6


def calibrate_efficiency(work: Workload, profile: DeviceClass, measured_seconds: float) -> float:
    """The efficiency at which ``predict_step_seconds`` equals a measured step (bisection; clamped to (0, 1])."""
    low, high = 1e-4, 1.0
    if predict_step_seconds(work, profile, high) >= measured_seconds:
        return high
    for _ in range(60):
        mid = math.sqrt(low * high)
        if predict_step_seconds(work, profile, mid) > measured_seconds:
            low = mid
        else:
            high = mid
    return high
