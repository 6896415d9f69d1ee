"""fleet.yaml ``limits``: what the coordinator accepts from its devices, and how long it waits on them.

The defaults are the transport guard's and the upload gate's own (``InboundLimits``, ``GateSettings``),
and the engine's assignment timings default to the ones here (``EngineSettings``): a fleet that leaves
the section out runs exactly as before. An operator tunes them for a fleet whose updates are bigger
than a ResNet (``max_upload_bytes``), whose devices talk more (``messages_per_s``), or whose honest
updates move further than ten times what they were sent (``norm_bound_factor``), whose honest
updates differ more than 3-fold between devices (``update_bound_factor``), or whose devices' data
differ so much that an honest update points away from the fleet's (``direction_min_cosine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, PositiveFloat, PositiveInt

from device_agent.wire.guard import InboundLimits

UPLOAD_HEADROOM = 4
"""The default ``max_upload_bytes`` over the fleet's largest honest upload: room for side information, a
safetensors header and a model larger than planned, while an abandoned transfer cannot hold a gigabyte (it
did: 1 GiB was the default against the demo's 0.38 MB uploads)."""
MIN_UPLOAD_BYTES = 16 << 20


@dataclass(frozen=True)
class GateSettings:
    """Bounds on what one device may claim; generous for honest devices, tight enough for absurd values."""

    max_samples_factor: float = 100.0
    """A device may claim at most this many times the samples the fleet expects of it, for training (samples weight
    the average) and for evaluation (test samples weight the federated accuracy). Every other number of the meta
    has its one range in :data:`device_agent.wire.bounds.UPLOAD_META`."""
    max_meta_entries: int = 16
    max_meta_chars: int = 256
    max_norm_ratio: float | None = 10.0
    """Refuse an update whose L2 norm exceeds this many times its reference (see the module doc); None: off."""
    norm_floor: float = 1.0
    """References below this count as this: near-zero tensors sent (fresh adapters) make no bound."""
    update_bound_factor: float | None = 3.0
    """Bound the update (upload minus sent, full rank) as a whole: the root mean square of its moving layers' ratios to
    their references (the fleet's median update norm of the layer over the previous rounds, scaled to the device's
    samples) at most this; None: the update bound off. 3: the demo's and the soak's honest updates stayed under 2.9,
    while two devices of ten boosting theirs 9.5x cost FedHM 0.8 points at 3 and 10 at 4
    (docs/robust-aggregation.md)."""
    update_layer_bound_factor: float | None = 6.0
    """Each layer alone at most this many times its reference (None: no bound per layer): one layer of an honest
    update jumps further than the whole (4.1x at most), an update boosted in a few layers only is held here."""
    update_bound_action: Literal["clip", "refuse"] = "clip"
    """clip: scale an update beyond the bound down to it; refuse: refuse the whole upload."""
    update_history_rounds: int = 5
    """Closed rounds of accepted update norms the median is taken over (never the open round's: a bound that learnt
    from the round's own uploads depended on their arrival order)."""
    update_reference_floor: float | None = 0.75
    """A layer's reference never falls below this share of the highest median it has had in the run (None: the
    median alone). A converged model's median update is 10-30x smaller than early on, while an honest device the
    model still fits worse moves about as far as the fleet did then: the soak clipped 72 of 1,661 such updates at
    the median alone. 0.75: the soak fleet's worst honest update 1.9x (0.5: 2.9x), two boosters of ten cost FedHM
    0.008 as before (1: 0.019) (docs/robust-aggregation.md)."""
    update_history_min: int = 3
    """Accepted norms a layer needs before its median counts; until then the warm-up bound applies."""
    update_still_ratio: float = 1e-3
    """A layer whose update is at most this share of the norm it was sent is still (no gradient reached it: a
    device whose one image or one class gives zero loss moves only by weight decay) and is left out of the
    median, so a majority of still devices cannot clip every informative update to nothing."""
    update_warmup_factor: float = 1.0
    """Warm-up: the layers without a median move by at most this many times the norm of what was sent."""
    direction_min_cosine: float | None = None
    """Refuse an update whose cosine with the fleet's direction of last round is below this; None: off.

    Off by default: on Fashion-MNIST with a ResNet-9 and Dirichlet(0.5) shards every honest update of a
    round pointed slightly away from the last round's direction (cosines -0.003 to -0.46) and was refused.
    """
    peer_min_cosine: float | None = -0.2
    """At the round's close, refuse an update whose cosine with the sum of the round's other updates (each a unit
    vote) is below this, in a round whose updates agree (``peer_min_agreement``), fewer than half the round at most;
    None: off. A same-round reference, so it holds on non-IID data where consecutive rounds point apart
    (docs/robust-aggregation.md). -0.2 (was -0.1 until 2026-11-29): an honest update of label-skewed digits read
    -0.12 in a round that agreed; an update a little under the round, round after round, is the record's
    (``peer_record_gap``)."""
    peer_min_updates: int = 4
    """Updates a round needs (with a direction sketch) before the peer check judges any of them."""
    peer_min_agreement: float | None = 0.2
    """``peer_min_cosine`` and ``peer_spread`` judge only a round whose median cosine is at least this (None: every
    round), and only such a round adds to the devices' records (``peer_record_gap``); a round below it has no
    direction to point against and only ``peer_hard_floor`` (and a bad record, on an update under the round's
    median) judges it. Once a model converges on non-IID shards, honest updates spread around 0 and down to -0.30
    (soaks' medians -0.14 to 0.09): a floor there refused up to 34 honest updates in 20 minutes. 0.2 (was 0.1 until
    2026-11-29 13:40): on label-skewed digits (Dirichlet(1.0)) FedAvg's medians fall from 0.46 to 0.1 over 20 rounds
    and the most skewed honest device read -0.31 at a median of 0.11; its deviations of rounds under 0.2 took its
    record to 0.22, into the backdoors' range."""
    peer_spread: float = 0.0
    """In a round that agrees, an update is refused only when it is also this many (scaled) median absolute
    deviations below the round's median cosine; 0: ``peer_min_cosine`` alone (no honest update of a round that
    agreed was seen below -0.02, while a wide spread let two reversed updates at -0.3 through)."""
    peer_hard_floor: float | None = -0.35
    """The peer check refuses an update below this cosine in every round, whether the round agrees or not (None:
    none); below the lowest honest cosine of every soak (-0.30), above colluders' reversed updates."""
    peer_outlier_deviations: float | None = None
    """In a round that agrees, also refuse an update more than this many scaled median absolute deviations (and
    ``peer_outlier_gap``) below the round's median cosine, above the floor too; None: off (and off with the peer
    check). Off by default since 2026-11-29: one round's cut at 4 (gap 0.3) refused an honest update of a
    label-skewed round 1, and let a backdoor through in rounds where it read close to the rest; the device's record
    (``peer_record_gap``) replaced it (docs/robust-aggregation.md)."""
    peer_outlier_gap: float = 0.3
    """The least distance under the round's median that ``peer_outlier_deviations`` refuses at."""
    peer_record_gap: float | None = 0.2
    """Refuse an update whose device's record lies more than this under its rounds' median cosine: the mean of its
    deviations over its last ``peer_record_rounds`` agreeing rounds, this one included, with
    ``peer_record_prior`` rounds of 0 (:class:`~coordinator.algorithms.robust.PeerHistory`); None: off. A backdoor
    device reads low in every round, an unusual honest one now and then (docs/robust-aggregation.md)."""
    peer_record_rounds: int = 10
    """Agreeing rounds a device's record is taken over."""
    peer_record_prior: float = 1.0
    """Rounds of 0 deviation every record starts with: one round alone counts for 1 / (1 + this) of itself."""
    sample_weight_factor: float | None = 2.0
    """An upload weighs at most this many times the samples the fleet expects of its device; None: no cap."""
    update_noise: float | None = None
    """Weak Gaussian noise on each round's aggregate (Sun et al. 2019): per weight, N(0, (z C / k)^2) with z this,
    C the norm of the fleet's median update (previous rounds) and k the updates folded, as DP-FedAvg's noise with C
    its clip norm (:mod:`coordinator.privacy`); None: none. It washes out what only one device teaches (a backdoor)."""

    def __post_init__(self) -> None:
        if self.max_norm_ratio is not None and self.max_norm_ratio <= 1:
            raise ValueError(
                f"max_norm_ratio must be > 1 (or None to turn the norm bound off), got {self.max_norm_ratio}"
            )
        if self.update_bound_factor is not None and self.update_bound_factor < 1:
            raise ValueError(f"update_bound_factor must be >= 1 (or None), got {self.update_bound_factor}")
        if self.update_layer_bound_factor is not None and self.update_layer_bound_factor < 1:
            raise ValueError(f"update_layer_bound_factor must be >= 1 (or None), got {self.update_layer_bound_factor}")
        if self.update_reference_floor is not None and not 0 < self.update_reference_floor <= 1:
            raise ValueError(f"update_reference_floor must be in (0, 1] (or None), got {self.update_reference_floor}")
        if self.update_history_rounds < 1 or self.update_history_min < 1:
            raise ValueError("update_history_rounds and update_history_min must be >= 1")
        if not 0 <= self.update_still_ratio < 1:
            raise ValueError(f"update_still_ratio must be in [0, 1), got {self.update_still_ratio}")
        if self.update_warmup_factor <= 0:
            raise ValueError(f"update_warmup_factor must be > 0, got {self.update_warmup_factor}")
        if self.peer_min_cosine is not None and not -1 <= self.peer_min_cosine < 1:
            raise ValueError(f"peer_min_cosine must be in [-1, 1) (or None), got {self.peer_min_cosine}")
        if not self.peer_spread >= 0:
            raise ValueError(f"peer_spread must be >= 0, got {self.peer_spread}")
        if self.peer_hard_floor is not None and not -1 <= self.peer_hard_floor < 1:
            raise ValueError(f"peer_hard_floor must be in [-1, 1) (or None), got {self.peer_hard_floor}")
        if self.peer_min_agreement is not None and not -1 <= self.peer_min_agreement < 1:
            raise ValueError(f"peer_min_agreement must be in [-1, 1) (or None), got {self.peer_min_agreement}")
        if self.peer_min_updates < 3:
            raise ValueError(f"peer_min_updates must be >= 3, got {self.peer_min_updates}")
        if self.update_noise is not None and not 0 <= self.update_noise < 10:
            raise ValueError(f"update_noise must be in [0, 10) (or None), got {self.update_noise}")
        if self.peer_outlier_deviations is not None and not self.peer_outlier_deviations > 0:
            raise ValueError(f"peer_outlier_deviations must be > 0 (or None), got {self.peer_outlier_deviations}")
        if not 0 <= self.peer_outlier_gap <= 2:
            raise ValueError(f"peer_outlier_gap must be in [0, 2], got {self.peer_outlier_gap}")
        if self.peer_record_gap is not None and not 0 < self.peer_record_gap <= 2:
            raise ValueError(f"peer_record_gap must be in (0, 2] (or None), got {self.peer_record_gap}")
        if self.peer_record_rounds < 1 or not self.peer_record_prior >= 0:
            raise ValueError(
                f"peer_record_rounds must be >= 1 and peer_record_prior >= 0, got {self.peer_record_rounds} and "
                f"{self.peer_record_prior}"
            )
        if self.sample_weight_factor is not None and self.sample_weight_factor < 1:
            raise ValueError(f"sample_weight_factor must be >= 1 (or None), got {self.sample_weight_factor}")


class FleetLimits(BaseModel):
    """Per-device bounds on inbound traffic and updates, and the engine's patience with assignments."""

    model_config = ConfigDict(extra="forbid")

    max_upload_bytes: ByteSize | None = Field(
        None,
        gt=0,
        description="bytes one device may have in flight to the coordinator, e.g. '256 MiB' or a number of bytes; "
        "unset: 4x the largest model its strategy sends or takes back (at least 16 MiB)",
    )
    messages_per_s: PositiveFloat = Field(
        InboundLimits.messages_per_s, description="control messages and manifests per second and device"
    )
    message_burst: PositiveInt = Field(
        InboundLimits.burst, description="messages a device may send at once before messages_per_s applies"
    )
    max_open_transfers: PositiveInt = Field(
        InboundLimits.max_open_transfers,
        description="unfinished uploads per device; a newer one drops the least recently active",
    )
    transfer_idle_s: PositiveFloat = Field(
        InboundLimits.idle_s,
        description="an unfinished upload with no chunk for this long is dropped (its memory freed) and its "
        "device told to send it again",
    )
    max_total_pending_bytes: ByteSize = Field(
        ByteSize(InboundLimits.max_total_pending_bytes),
        gt=0,
        description="bytes all devices together may hold in unfinished uploads; past it a new upload waits",
    )
    norm_bound_factor: float | None = Field(
        GateSettings.max_norm_ratio,
        gt=1,
        description="refuse an update whose L2 norm exceeds this many times its reference; null: no bound",
    )
    update_bound_factor: float | None = Field(
        GateSettings.update_bound_factor,
        ge=1,
        description="bound the update as a whole (the root mean square of its layers' ratios to the fleet's recent "
        "median update norm, scaled to the device's samples) at this; null: the update bound off",
    )
    update_layer_bound_factor: float | None = Field(
        GateSettings.update_layer_bound_factor,
        ge=1,
        description="bound each layer's update alone at this many times its reference; null: no bound per layer",
    )
    update_bound_action: Literal["clip", "refuse"] = Field(
        GateSettings.update_bound_action, description="clip an update beyond the bound down to it, or refuse it"
    )
    update_history_rounds: PositiveInt = Field(
        GateSettings.update_history_rounds, description="rounds of accepted update norms the median is taken over"
    )
    update_reference_floor: float | None = Field(
        GateSettings.update_reference_floor,
        gt=0,
        le=1,
        description="a layer's reference never falls below this share of the highest median it has had in the run "
        "(a converged model's median update collapses, its worst-fit honest device's does not); null: the median "
        "alone",
    )
    update_still_ratio: float = Field(
        GateSettings.update_still_ratio,
        ge=0,
        lt=1,
        description="a layer whose update is at most this share of its norm as sent did not learn (no gradient "
        "reached it) and is left out of the median",
    )
    update_warmup_factor: PositiveFloat = Field(
        GateSettings.update_warmup_factor,
        description="until a layer has a median: its update may be this many times the norm of what was sent",
    )
    direction_min_cosine: float | None = Field(
        GateSettings.direction_min_cosine,
        ge=-1,
        lt=1,
        description="refuse an update whose cosine with the fleet's update direction of last round (the sum of "
        "its accepted updates, each scaled to unit norm) is below this, e.g. 0; null (the default): no direction "
        "check (consecutive honest rounds can point apart on non-IID data)",
    )
    peer_min_cosine: float | None = Field(
        GateSettings.peer_min_cosine,
        ge=-1,
        lt=1,
        description="at the round's close, refuse an update whose cosine with the sum of the round's other updates "
        "(each scaled to unit norm) is below this, never half the round or more; null: off (FedAvg, FedHM)",
    )
    peer_min_updates: int = Field(
        GateSettings.peer_min_updates, ge=3, description="updates a round needs before the peer check judges any"
    )
    peer_min_agreement: float | None = Field(
        GateSettings.peer_min_agreement,
        ge=-1,
        lt=1,
        description="peer_min_cosine and peer_spread judge only a round whose median cosine is at least this, and "
        "only such a round adds to the devices' records; below it (a converged model's honest updates spread around "
        "0) only peer_hard_floor does, and a bad record only on an update under the round's median; null: every round",
    )
    peer_spread: float = Field(
        GateSettings.peer_spread,
        ge=0,
        description="in a round that agrees, the peer check refuses only updates also this many median absolute "
        "deviations below the round's median cosine; 0: peer_min_cosine alone",
    )
    peer_hard_floor: float | None = Field(
        GateSettings.peer_hard_floor,
        ge=-1,
        lt=1,
        description="the peer check refuses an update whose cosine is below this in every round, whether it "
        "agrees or not; null: none",
    )
    peer_outlier_deviations: float | None = Field(
        GateSettings.peer_outlier_deviations,
        gt=0,
        description="in a round that agrees, the peer check also refuses an update this many median absolute "
        "deviations (and peer_outlier_gap) below the round's median cosine, even above peer_min_cosine; null: off",
    )
    peer_outlier_gap: float = Field(
        GateSettings.peer_outlier_gap,
        ge=0,
        le=2,
        description="the least distance below the round's median cosine at which peer_outlier_deviations refuses",
    )
    peer_record_gap: float | None = Field(
        GateSettings.peer_record_gap,
        gt=0,
        le=2,
        description="the peer check also refuses an update whose device's record (its mean cosine under its "
        "rounds' median over its last peer_record_rounds agreeing rounds, this one included, with peer_record_prior "
        "rounds of 0) is more than this under; null: off",
    )
    peer_record_rounds: PositiveInt = Field(
        GateSettings.peer_record_rounds, description="agreeing rounds a device's record is taken over"
    )
    peer_record_prior: float = Field(
        GateSettings.peer_record_prior,
        ge=0,
        description="rounds of 0 every record starts with: one round alone counts for 1 / (1 + this) of itself",
    )
    sample_weight_factor: float | None = Field(
        GateSettings.sample_weight_factor,
        ge=1,
        description="an upload weighs at most this many times its device's expected samples; null: no cap",
    )
    update_noise: float | None = Field(
        GateSettings.update_noise,
        ge=0,
        lt=10,
        description="weak Gaussian noise on each round's aggregate, per weight N(0, (z C / k)^2): z this, C the "
        "norm of the fleet's median update of the previous rounds, k the updates folded; null: none (FedAvg, FedHM)",
    )
    rejected_grace_s: float = Field(
        10.0, ge=0, description="how long a device whose update was refused may still send a valid one"
    )
    resend_after_s: PositiveFloat = Field(
        5.0, description="a participant that says it is idle this long after its assignment gets it again"
    )
    laggard_grace_factor: float = Field(
        3.0,
        ge=1,
        description="once the round has its quorum of accepted updates, it waits for the rest at most this many "
        "times the median time its accepted updates took (from their assignments), and at least laggard_grace_min_s",
    )
    laggard_grace_min_s: float = Field(
        30.0,
        ge=0,
        description="the least a round with its quorum waits for each laggard, from its assignment (see "
        "laggard_grace_factor); keep it above the agents' heartbeat plus resend_after_s",
    )
    backoff_after: int = Field(
        3,
        ge=0,
        description="a device that misses or is refused this many rounds in a row sits out 1 round, then 2, 4, ... "
        "after each further miss (at most backoff_max_rounds); 0: never",
    )
    backoff_max_rounds: PositiveInt = Field(16, description="the most rounds a missing device sits out at a time")

    def inbound(self, largest_upload: int) -> InboundLimits:
        """The transport guard's bounds, ``largest_upload`` the bytes of the fleet's largest honest upload: one
        upload may use all of a device's pending bytes, as by default."""
        most = self.max_upload_bytes or max(UPLOAD_HEADROOM * largest_upload, MIN_UPLOAD_BYTES)
        return InboundLimits(
            max_transfer_bytes=most,
            max_pending_bytes=most,
            max_open_transfers=self.max_open_transfers,
            messages_per_s=self.messages_per_s,
            burst=self.message_burst,
            idle_s=self.transfer_idle_s,
            max_total_pending_bytes=self.max_total_pending_bytes,
        )

    def gate(self) -> GateSettings:
        """The upload gate's bounds: the norm factors from here, the meta bounds the gate's own."""
        return GateSettings(
            max_norm_ratio=self.norm_bound_factor,
            update_bound_factor=self.update_bound_factor,
            update_layer_bound_factor=self.update_layer_bound_factor,
            update_bound_action=self.update_bound_action,
            update_history_rounds=self.update_history_rounds,
            update_reference_floor=self.update_reference_floor,
            update_still_ratio=self.update_still_ratio,
            update_warmup_factor=self.update_warmup_factor,
            direction_min_cosine=self.direction_min_cosine,
            peer_min_cosine=self.peer_min_cosine,
            peer_min_updates=self.peer_min_updates,
            peer_min_agreement=self.peer_min_agreement,
            peer_spread=self.peer_spread,
            peer_hard_floor=self.peer_hard_floor,
            peer_outlier_deviations=self.peer_outlier_deviations,
            peer_outlier_gap=self.peer_outlier_gap,
            peer_record_gap=self.peer_record_gap,
            peer_record_rounds=self.peer_record_rounds,
            peer_record_prior=self.peer_record_prior,
            sample_weight_factor=self.sample_weight_factor,
            update_noise=self.update_noise,
        )


__all__ = ["FleetLimits"]
