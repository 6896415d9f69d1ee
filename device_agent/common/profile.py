"""The device profile: what a device can do, as the coordinator, the cost model and the ``hello`` message see it.

The ``memory`` / ``compute`` / ``network`` sections are what the coordinator's static device profiles
(``profiles/``) are made of, and what the agent's probe measures, so a measured report replaces a
datasheet section by section. It lives at the bottom so that profiles, the wire and the probe share it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator


class MemorySpec(BaseModel):
    """Memory of the device that trains: GPU memory when dedicated, system memory when shared."""

    model_config = ConfigDict(extra="forbid")

    total: ByteSize = Field(description="memory of the training device, e.g. '4 GiB' or a number of bytes")
    shared: bool = Field(description="true when the OS and CPU use the same memory (Raspberry Pi, Jetson, Apple M)")
    reserved: ByteSize = Field(
        ByteSize(0), description="held by the OS, the desktop and other processes: training gets total - reserved"
    )

    @model_validator(mode="after")
    def _reserved_below_total(self) -> MemorySpec:
        if self.reserved >= self.total:
            raise ValueError(
                f"reserved ({self.reserved.human_readable()}) must be below total ({self.total.human_readable()})"
            )
        return self

    @property
    def usable_bytes(self) -> int:
        return int(self.total) - int(self.reserved)


class ComputeSpec(BaseModel):
    """Throughput numbers a training step's duration is predicted from."""

    model_config = ConfigDict(extra="forbid")

    # Lower bounds, not just > 0: a reported 5e-324 GFLOPS underflowed the cost model's rates to 0.0
    # (ZeroDivisionError in the coordinator's planning). Nothing trains below a MFLOPS anyway.
    fp32_gflops: float = Field(ge=1e-3, description="fp32 matmul throughput (datasheet peak, or measured by the probe)")
    memory_bandwidth_gbs: float | None = Field(
        None, gt=0, description="GB/s that bandwidth-bound kernels reach (datasheet peak, or probed); None: unknown"
    )
    fresh_memory_bandwidth_gbs: float | None = Field(
        None,
        gt=0,
        description="GB/s of the same kernels on tensors over glibc's 32 MiB mmap threshold, whose pages fault in "
        "each step (CPU; probed); None: memory_bandwidth_gbs",
    )
    training_efficiency: float | None = Field(
        None,
        ge=1e-3,
        le=4,
        description="training convolutions' rate over fp32_gflops (probed; may exceed 1 on a CPU); None: default",
    )
    kernel_overhead_us: float | None = Field(
        None, ge=0, description="fixed cost per launched operator (Python + dispatch + launch); None = default"
    )


class NetworkSpec(BaseModel):
    """The device's link to the broker; a round moves the model down and the update up over it."""

    model_config = ConfigDict(extra="forbid")

    downlink_mbps: float = Field(gt=0, description="broker -> device, Mbit/s")
    uplink_mbps: float = Field(gt=0, description="device -> broker, Mbit/s")
    latency_ms: float = Field(ge=0, description="one-way latency to the broker")


class DeviceProfile(BaseModel):
    """One device as the coordinator sees it; field names are part of the wire protocol.

    The flat fields are the original report; ``memory``/``compute``/``network`` restate it in the
    shape of a static profile (derived from the flat fields when a sender leaves them out).
    """

    protocol_version: int = 1
    hostname: str
    platform: str
    machine: str
    python: str
    torch: str
    cpu_count: int
    memory_total_bytes: int
    memory_available_bytes: int
    accelerator: str
    accelerator_name: str | None
    accelerator_memory_bytes: int | None
    matmul_gflops: float
    memory: MemorySpec
    compute: ComputeSpec
    network: NetworkSpec | None = None
    versions: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _sections_from_flat_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        # Derived only from integers: anything else is left to the fields' own validation, which names it.
        flat = (
            data.get("memory_total_bytes"),
            data.get("memory_available_bytes"),
            data.get("accelerator_memory_bytes"),
        )
        if "memory" not in data and all(_is_int(v) for v in flat[:2]) and (flat[2] is None or _is_int(flat[2])):
            total = data.get("accelerator_memory_bytes") or data["memory_total_bytes"]
            shared = data.get("accelerator") != "cuda"
            reserved = total - data["memory_available_bytes"] if shared else 0
            data["memory"] = {"total": total, "shared": shared, "reserved": max(0, min(reserved, total - 1))}
        if "compute" not in data and "matmul_gflops" in data:
            data["compute"] = {"fp32_gflops": data["matmul_gflops"]}
        return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
