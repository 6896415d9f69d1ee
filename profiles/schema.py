"""The schema of a device-class profile: what the planner knows about a device before it reports.

The ``memory`` / ``compute`` / ``network`` sections are the device agent's own probe models, so a
measured report (``device_agent.agent.probe.DeviceProfile``) overrides a profile section by section.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from device_agent.common.profile import ComputeSpec, MemorySpec, NetworkSpec

Accelerator = Literal["cpu", "cuda", "mps"]
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class Source(BaseModel):
    """Where some of a profile's numbers come from, and whether they are estimates."""

    model_config = ConfigDict(extra="forbid")

    fields: list[str] = Field(
        min_length=1, description="dotted field paths this source covers, e.g. compute.fp32_gflops"
    )
    ref: str = Field(min_length=1, description="datasheet, review or measurement the numbers come from")
    estimate: bool = Field(False, description="true when the numbers are estimated rather than published or measured")


class DeviceClass(BaseModel):
    """One kind of device (a Jetson Orin Nano 8GB, a Raspberry Pi 5...), as planning sees it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="lower-case id used in fleet.yaml, e.g. jetson-orin-nano-8gb")
    title: str = Field(min_length=1)
    accelerator: Accelerator = Field(description="what trains: cpu, cuda or mps")
    memory: MemorySpec
    compute: ComputeSpec
    network: NetworkSpec
    sources: list[Source] = Field(min_length=1)
    notes: str = ""

    @field_validator("name")
    @classmethod
    def _slug(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(f"profile name {name!r} must be lower-case letters, digits and dashes")
        return name

    @model_validator(mode="after")
    def _sources_name_real_fields(self) -> DeviceClass:
        known = {
            f"{section}.{field}" for section in ("memory", "compute", "network") for field in _fields(self, section)
        }
        for index, source in enumerate(self.sources):
            unknown = sorted(set(source.fields) - known)
            if unknown:
                raise ValueError(f"sources[{index}].fields: unknown field(s) {', '.join(unknown)}")
        return self

    @property
    def estimated_fields(self) -> list[str]:
        return sorted({field for source in self.sources if source.estimate for field in source.fields})


def _fields(profile: DeviceClass, section: str) -> list[str]:
    return list(type(getattr(profile, section)).model_fields)
