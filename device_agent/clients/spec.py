"""What a coordinator tells a device to train: one typed spec per strategy, plus the training config.

The spec travels in the ``Assignment`` message as JSON and is parsed by its ``strategy`` into the
class the registered client program consumes (:mod:`device_agent.clients.registry`), so a device
gets exactly the class its program was written against, and a new strategy edits no union here. Every field is
required and unknown keys are errors: a typo or a newer coordinator's option fails loudly instead
of being silently replaced by a default on the device. Pure pydantic, no torch: the wire messages
import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.dataclasses import dataclass

from device_agent.clients.registry import PROGRAMS, literal_names
from device_agent.common.validation import describe

Optimizer = Literal["sgd", "momentum", "adam"]
"""sgd: plain SGD; momentum: SGD with heavy-ball momentum; adam: Adam (decoupled from momentum)."""


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ModelSpec:
    """The model every party builds on; ``arch`` is a key of ``device_agent.models.MODELS``."""

    arch: str
    num_classes: PositiveInt
    in_channels: PositiveInt
    image_size: Annotated[int, Field(ge=1)]


class TrainConfig(BaseModel):
    """Local training: the options of fleet.yaml's ``training`` section, as the device applies them.

    ``momentum`` applies to the ``momentum`` optimizer only (Adam keeps its own moments); it must
    be 0 with ``sgd`` so a config never claims momentum it does not get. ``weight_decay`` is plain
    L2 on dense parameters; FedHM's factors get Frobenius decay instead (its spec's ``frobenius_decay``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    optimizer: Optimizer = "momentum"
    lr: PositiveFloat = 0.05
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    weight_decay: Annotated[float, Field(ge=0)] = 5e-4
    epochs: PositiveInt = 1
    batch_size: PositiveInt = 32
    seed: int = 0
    mask_absent_classes: bool = True
    absent_class_fill: Literal["-inf", "zero"] = "-inf"

    @model_validator(mode="after")
    def _momentum_only_with_momentum(self) -> TrainConfig:
        if self.optimizer == "sgd" and self.momentum != 0 and "momentum" in self.model_fields_set:
            raise ValueError("momentum is set but optimizer is 'sgd'; use optimizer 'momentum' or drop momentum")
        return self

    @property
    def effective_momentum(self) -> float:
        return self.momentum if self.optimizer == "momentum" else 0.0


class ClipOrder(BaseModel):
    """User-level differential privacy: the device clips its whole update to L2 norm ``norm`` before upload.

    See :mod:`device_agent.training.clipping` for the space it is measured in and docs/privacy.md for the rest.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    norm: PositiveFloat
    report_unclipped: bool
    """Adaptive clipping: send whether the update was within ``norm`` (one bit; the coordinator noises the count)."""


class SpecBase(BaseModel):
    """Fields every strategy's client needs: what to build, and at which level."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: str
    """The registry name of the server strategy; each concrete spec narrows it to its own literal(s)."""
    model: ModelSpec
    level: Annotated[float, Field(gt=0, le=1)]
    """FedHM rank ratio gamma, HeteroFL/FedRolex width rate, or 1.0 (the whole model)."""
    clip: ClipOrder | None = None
    """Set when the fleet runs with ``privacy:``; None: the upload goes as trained. The one optional field: an
    agent that predates it refuses a spec that carries it (unknown key), never training without clipping."""


class FedHMSpec(SpecBase):
    """FedHM: the hybrid low-rank model at rank ratio ``level``; factors get Frobenius decay."""

    strategy: Literal["fedhm"]
    frobenius_decay: Annotated[float, Field(ge=0)]
    send_classes: bool
    """Report the local classes: the server's label-masked classifier counts only their rows."""


class WidthSpec(SpecBase):
    """A dense model of width ``level``: FedAvg (1.0), FedAvg on the smallest model, HeteroFL, FedRolex."""

    strategy: Literal["fedavg", "fedavg_small", "heterofl", "fedrolex"]
    scaler: bool
    """HeteroFL's Scaler: convolution outputs divided by the width rate during training only."""
    send_classes: bool
    """Report the local classes so the server averages only the classifier rows this device trained."""


class RankOneSpec(SpecBase):
    """Models of rank-one-plus-sparse layers (W = u v^T + mu), trained with L1 on the live mu."""

    layout: Literal["kernel", "channel"]
    """kernel: u spans kernel positions (Factorized-FL); channel: u spans input channels x kernel (SimFed)."""
    lambda_sparsity: Annotated[float, Field(ge=0)]
    prune_below: Annotated[float, Field(ge=0)]


class FactorizedFLSpec(RankOneSpec):
    """Factorized-FL: u of the shared layers and v of the similarity layer go back."""

    strategy: Literal["factorized_fl"]
    share_head: bool


class FactorizedFLBetaSpec(RankOneSpec):
    """Factorized-FL beta: u, v and mu of the shared layers go back (label-synchronized settings)."""

    strategy: Literal["factorized_fl_beta"]
    share_head: bool


class SimFedSpec(RankOneSpec):
    """SimFed: the whole model back, plus the encoder's embedding of the server's criteria input."""

    strategy: Literal["simfed"]


class FedFacSpec(SpecBase):
    """FedFac: a plain dense model; the server decides which elements are shared."""

    strategy: Literal["fedfac"]


class LoRASpec(SpecBase):
    """Fine-tuning a pre-trained transformer: LoRA adapters of rank ``rank`` or all of it (ft).

    ``level`` is ``rank / max_rank`` (the planner's (0, 1] scale; FedLoRA's r in {2, 4, 8, 16} is
    levels 1/8 ... 1 with max_rank 16); ``rank`` is what the device builds. The frozen base is
    identified by ``base_sha256``: the device trains on a base with exactly that digest, sent
    with its first assignment and kept on the device afterwards.
    """

    strategy: Literal["fedlora", "lora_homogeneous", "hetlora", "flora", "ft"]
    rank: PositiveInt | None
    """None: full fine-tuning (ft), every parameter trained and exchanged."""
    alpha: PositiveFloat
    """LoRA scale numerator: the bypass is scaled by ``scale`` (alpha / rank by default)."""
    scale: Literal["alpha_over_r", "one", "rslora"]
    """alpha_over_r: alpha / r; one: 1 (the FedHM reference code, alpha = r); rslora: alpha / sqrt(r)."""
    targets: Literal["attn", "attn_mlp"]
    """attn: W^Q, W^K, W^V, W^O (the paper); attn_mlp: also both MLP layers."""
    adapter_layout: Literal["separate", "fused_qkv"]
    """separate: a bypass per q, k, v, proj; fused_qkv: one on the fused qkv projection plus one on proj (the paper)."""
    train_head: bool
    """Train and exchange the classifier head; false keeps the pre-trained head frozen (part of the base)."""
    base_sha256: str | None

    @model_validator(mode="after")
    def _rank_and_base_only_with_lora(self) -> LoRASpec:
        lora = self.strategy != "ft"
        if lora != (self.rank is not None) or lora != (self.base_sha256 is not None):
            raise ValueError("rank and base_sha256 are required with LoRA strategies and must be null with ft")
        return self


def parse_spec(raw: object) -> SpecBase:
    """A spec from JSON-like data, as the class registered for its ``strategy``; ``ValueError`` naming each field."""
    if isinstance(raw, SpecBase):
        return raw
    name = raw.get("strategy") if isinstance(raw, Mapping) else None
    if not isinstance(name, str):
        raise ValueError("invalid client spec: spec.strategy: a strategy name is required")
    program = PROGRAMS.get(name)
    if program is None:
        known = ", ".join(PROGRAMS) or "none"
        raise ValueError(f"invalid client spec: spec.strategy: unknown strategy {name!r} (this agent trains: {known})")
    try:
        return program.Spec.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"invalid client spec: {describe(exc, prefix='spec')}") from None


def spec_types() -> list[type[SpecBase]]:
    """Every registered spec class, once each (several strategies may share one)."""
    return list(dict.fromkeys(program.Spec for program in PROGRAMS.values()))


ClientSpec = Annotated[SpecBase, SerializeAsAny(), BeforeValidator(parse_spec)]
"""The spec field of a wire message: validated as its strategy's registered class, serialized whole."""
CLIENT_SPEC: TypeAdapter[SpecBase] = TypeAdapter(ClientSpec)


def strategies_of(spec_type: type[SpecBase]) -> tuple[str, ...]:
    """The strategy names a spec class serves (the values of its ``strategy`` literal)."""
    return literal_names(spec_type)


__all__ = [
    "CLIENT_SPEC",
    "ClientSpec",
    "ClipOrder",
    "FactorizedFLBetaSpec",
    "FactorizedFLSpec",
    "FedFacSpec",
    "FedHMSpec",
    "LoRASpec",
    "ModelSpec",
    "Optimizer",
    "RankOneSpec",
    "SimFedSpec",
    "SpecBase",
    "TrainConfig",
    "WidthSpec",
    "parse_spec",
    "spec_types",
    "strategies_of",
]
