"""fleet.yaml ``privacy``: how much noise, which delta, how updates are clipped, and the budget that stops a run."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Clip(_Strict):
    """How devices clip: one fixed L2 norm, or adaptive (Andrew et al. 2021).

    Adaptive: the norm follows a quantile of the devices' update norms, read from a noised count. Each round
    C <- C * exp(-learning_rate * (b - quantile)), b the noised fraction of devices whose update was within C. The
    count's noise (``count_noise``) is taken out of the update's so the total stays the configured multiplier
    (docs/privacy.md).
    """

    mode: Literal["fixed", "adaptive"] = Field("fixed", description="fixed: one norm; adaptive: a quantile's norm")
    norm: PositiveFloat | None = Field(None, description="fixed: the L2 norm every device clips its whole update to")
    initial: PositiveFloat = Field(0.1, description="adaptive: the clip norm of the first round")
    quantile: float = Field(0.5, gt=0, lt=1, description="adaptive: the fraction of devices to leave unclipped")
    learning_rate: PositiveFloat = Field(0.2, description="adaptive: step of the geometric update of the clip norm")
    count_noise: PositiveFloat | None = Field(
        None,
        description="adaptive: std of the noise on the count of unclipped devices; default max(expected "
        "participants / 20, noise multiplier)",
    )

    @model_validator(mode="after")
    def _norm_only_when_fixed(self) -> Clip:
        if self.mode == "fixed" and self.norm is None:
            raise ValueError("norm: a fixed clip needs its norm (or write `mode: adaptive`)")
        if self.mode == "adaptive" and self.norm is not None:
            raise ValueError("norm: an adaptive clip starts at `initial` and moves; drop norm")
        return self

    @property
    def adaptive(self) -> bool:
        return self.mode == "adaptive"

    @property
    def first_norm(self) -> float:
        """The clip norm of the first round."""
        return self.initial if self.adaptive else float(self.norm)  # type: ignore[arg-type]


class PrivacySettings(_Strict):
    """User-level central DP (DP-FedAvg). Give ``noise_multiplier`` or ``target_epsilon``, not both."""

    noise_multiplier: PositiveFloat | None = Field(
        None, description="z: the noise added to the round's sum is N(0, z^2 C^2) per coordinate"
    )
    target_epsilon: PositiveFloat | None = Field(
        None, description="calibrate z so that the configured rounds end at this epsilon (at delta)"
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta epsilon is stated at; below 1 / number of devices")
    clip: Clip = Field(description="a number (a fixed L2 norm) or {mode: adaptive, quantile: ...}")
    budget_epsilon: PositiveFloat | None = Field(
        None, description="stop before a round that would take epsilon past this (default: target_epsilon, if set)"
    )

    @field_validator("clip", mode="before")
    @classmethod
    def _number_is_fixed(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"mode": "fixed", "norm": value}
        return value

    @model_validator(mode="after")
    def _one_noise_source(self) -> PrivacySettings:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier or target_epsilon")
        return self

    @property
    def budget(self) -> float | None:
        """The epsilon the run may not pass: ``budget_epsilon``, else ``target_epsilon``, else none."""
        return self.budget_epsilon if self.budget_epsilon is not None else self.target_epsilon


__all__ = ["Clip", "PrivacySettings"]
