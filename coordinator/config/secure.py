"""fleet.yaml ``secure_aggregation``: SecAgg+ (device_agent.secagg) for a round's updates, and where it cannot run.

Under secure aggregation the coordinator learns only the sum of a round's updates. Whatever reads one device's
update is then out: the upload gate's screening (update bound, direction and peer checks) and strategies whose
aggregate is not a plain sum of what devices send. ``problems`` names each such contradiction with its key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat

from device_agent.secagg.errors import ParameterError
from device_agent.secagg.graph import validate
from device_agent.secagg.quantize import Quantizer

SUPPORTED_STRATEGIES = frozenset(
    {"fedavg", "fedavg_small", "heterofl", "fedrolex", "fedhm", "ft", "lora_homogeneous", "hetlora", "fedlora"}
)
"""Strategies whose round runs under secure aggregation (coordinator/rounds/secure_layouts.py): their aggregate is
a weighted sum of what devices send (HetLoRA's factors zero-padded to max_rank), or (FedHM, fedlora) of the dense
updates devices rebuild from it."""
WHY_NOT: dict[str, str] = {
    "factorized_fl": "it is personalized: each device's new u mixes the round's u by the similarity of the devices' "
    "own v, a different weighted sum per recipient (one protocol run each, or the v in the clear); a single sum "
    "would be a global u, not Factorized-FL",
    "factorized_fl_beta": "it is personalized (as factorized_fl), and mixes v and mu too",
    "simfed": "its similarity weights read each device's own embedding",
    "fedfac": "the coordinator picks the shared elements from the raw updates",
    "flora": "stacking puts each device's factors in its own block, so the 'sum' would show every device's factors",
}
"""Why a strategy does not run under secure aggregation, named in fleet.yaml's refusal."""
SCREENING = ("update_bound_factor", "direction_min_cosine", "peer_min_cosine", "peer_hard_floor", "update_noise")
"""The ``limits`` that read one device's update (``update_noise`` scales by the median update's norm): each must be
null (off) under secure aggregation."""


PROTOCOL_BYTES_PER_NEIGHBOUR, PROTOCOL_BYTES = 640, 600
"""A device's protocol messages per round (keys, sealed shares, forwarded shares, unmask answers), measured."""
NOISE_RANGE = 6.0
"""Under privacy the quantization range must reach this many noise stds: a clamp then happens once in 5e8 values."""
EXCHANGES = 3
"""Round trips the protocol adds to a round (keys, shares, unmasking): the planner counts their latency."""


class SecureAggregation(BaseModel):
    """SecAgg+ parameters (docs/secure-aggregation.md): the sparse graph's degree, the threshold, the quantization."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: int = Field(
        description="neighbours of a device that must stay to the end for its masks to be removed (2..neighbours)"
    )
    neighbours: int = Field(
        description="the degree of the SecAgg+ graph: even, or the round's devices - 1 (every other device)"
    )
    clip: PositiveFloat = Field(
        0.5, description="update values must lie in [-clip, clip]: a device clamps its update to it before masking"
    )
    bits: int = Field(16, ge=1, le=32, description="quantization levels per value: 2^bits - 1")

    def upload_bytes(self, values: int, devices: int) -> int:
        """What a device sends per round under SecAgg+ when its masked vector covers ``values`` values, in a round
        of ``devices``: the masked words (4 bytes up to a 32-bit ring, else 8) and the protocol's messages.

        The protocol's bytes follow ``python -m benchmarks.secagg`` (extra bytes per device, both ways, at 10, 100
        and 300 devices: 6.4, 12.3 and 17.3 KB for 9, 20 and 26 neighbours): about 640 bytes per neighbour plus
        600, all counted as upload here (uplinks are the slow side)."""
        quantizer = Quantizer(clip=self.clip, bits=self.bits, devices=max(2, devices))
        word = 4 if quantizer.modulus_bits <= 32 else 8
        neighbours = min(self.neighbours, max(1, devices - 1))
        return values * word + PROTOCOL_BYTES_PER_NEIGHBOUR * neighbours + PROTOCOL_BYTES

    def problems(
        self,
        devices: int,
        strategy: str,
        limits: Mapping[str, object],
        privacy: bool,
        params: Mapping[str, object] | None = None,
        adaptive_clip: bool = False,
        device_noise: float | None = None,
    ) -> list[str]:
        """What contradicts this setting in a fleet of ``devices`` a round (``key: why``), empty when it fits.

        ``params``: the strategy's (``strategy.params``); some of their values read single updates. ``privacy``:
        fleet.yaml has ``privacy:`` (``adaptive_clip``: with an adaptive clip norm; ``device_noise``: the std of the
        noise each device adds, z C / sqrt(devices), when fleet.yaml fixes z and C)."""
        found = []
        if strategy not in SUPPORTED_STRATEGIES:
            why = WHY_NOT.get(strategy, "its aggregate must be a sum of the devices' uploads")
            found.append(
                f"strategy.name: {strategy!r} does not run under secure aggregation: {why} (supported: "
                f"{', '.join(sorted(SUPPORTED_STRATEGIES))})"
            )
        found += [f"strategy.params.{key}: {why}" for key, why in _params_problems(strategy, params or {})]
        screening = [key for key in SCREENING if limits.get(key) is not None]
        if screening:
            found.append(
                f"limits: {', '.join(screening)} read each device's update, which the coordinator never sees under "
                "secure aggregation; set them to null (the fleet then has no screening against poisoned updates)"
            )
        if privacy and strategy != "fedavg":
            found.append(
                f"privacy: distributed noise under secure aggregation is wired for fedavg only, not {strategy!r} "
                "(docs/secure-aggregation.md)"
            )
        if privacy and adaptive_clip:
            found.append(
                "privacy.clip: adaptive clipping counts the devices that were not clipped, one bit each, which the "
                "coordinator never sees under secure aggregation; use a fixed clip norm"
            )
        if device_noise is not None and self.clip < NOISE_RANGE * device_noise:
            found.append(
                f"clip: {self.clip:g} does not cover the privacy noise each device adds (std z C / sqrt({devices}) = "
                f"{device_noise:.4g}): values past it are clamped, and a clamped noise is not the Gaussian mechanism "
                f"the accountant charges; set clip to at least {NOISE_RANGE:g} x that, {NOISE_RANGE * device_noise:.3g}"
            )
        try:
            validate(devices, self.threshold, self.neighbours)
            Quantizer(clip=self.clip, bits=self.bits, devices=devices)
        except ParameterError as exc:
            found.append(f"{exc} (a round asks {devices} devices)")
        return found


def _params_problems(strategy: str, params: Mapping[str, object]) -> list[tuple[str, str]]:
    """Strategy parameters that need single updates, which the coordinator never sees under secure aggregation."""
    found = []
    if strategy == "fedavg" and params.get("rule", "mean") != "mean":
        found.append(("rule", f"{params['rule']!r} ranks single uploads; only 'mean' is a sum"))
    masked = params.get("label_masked_classifier", True)
    if strategy in ("heterofl", "fedrolex") and masked and params.get("weighting", "uniform") != "uniform":
        why = "a label-masked classifier's holders are counted under the masks only with uniform weighting"
        found.append(("weighting", why + "; use weighting: uniform or label_masked_classifier: false"))
    if strategy == "fedhm" and params.get("label_masked_classifier", "off") != "off":
        why = "weighs each classifier row by the classes of the devices holding it; only 'off' is wired"
        found.append(("label_masked_classifier", why))
    if strategy == "hetlora" and params.get("weighting", "sparsity") != "samples":
        why = "'sparsity' weighs each device by ||B_i A_i||_F, read from its own factors; use weighting: samples"
        found.append(("weighting", why))
    if strategy == "fedhm" and params.get("global_as_pseudo_client"):
        found.append(("global_as_pseudo_client", "depends on which devices survived at full rank; set it false"))
    return found


def round_size(devices: int, participation: float) -> int:
    """How many devices a round asks when every device can take part (``ParticipantDraw``'s count)."""
    return math.ceil(participation * devices)


__all__ = ["EXCHANGES", "SCREENING", "SUPPORTED_STRATEGIES", "WHY_NOT", "SecureAggregation", "round_size"]
