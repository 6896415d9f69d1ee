"""Schemas that fleet.yaml, agent.yaml and the wire protocol share, defined once.

The coordinator reads fleet.yaml, a device reads agent.yaml, and both speak the wire protocol; a
fleet name, a password reference or a partition that one side accepts must mean the same on the
other. Each of these lives here, in the agent package, because the coordinator may import the agent
and never the reverse.

- names (fleet, device, run ids): :data:`NAME_PATTERN`, :func:`check_name`, :data:`FleetName`...;
- secret references ``env:NAME`` / ``file:PATH``: :func:`check_secret_ref`, :func:`resolve_secret`;
- partitions: :class:`Partition` (``iid``, ``permuted_labels``, ``dirichlet(ALPHA)``, ``domains`` or
  ``domains(N)``); data set names live in :mod:`device_agent.common.names`.
"""

from __future__ import annotations

import math
import os
import re
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator

from device_agent.data.partition import PartitionSpec

# Names become MQTT topic levels and broker user names: no wildcards, no slashes, bounded length.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME = re.compile(NAME_PATTERN)


def check_name(kind: str, name: str) -> str:
    """``name`` if it is a valid fleet/device/run name, else a ValueError saying what a name may hold."""
    if not _NAME.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter "
            "or digit (it becomes an MQTT topic level)"
        )
    return name


FleetName = Annotated[str, AfterValidator(partial(check_name, "fleet"))]
DeviceName = Annotated[str, AfterValidator(partial(check_name, "device"))]
RunId = Annotated[str, AfterValidator(partial(check_name, "run"))]

_SECRET_REF = re.compile(r"^(env:[A-Za-z_][A-Za-z0-9_]*|file:.+)$")


class SecretError(ValueError):
    """A secret reference that points at nothing (an unset variable, an unreadable file)."""


def check_secret_ref(ref: str | None) -> str | None:
    """``ref`` if it is ``env:NAME`` or ``file:PATH`` (or None); files hold references, never secrets."""
    if ref is None or _SECRET_REF.match(ref):
        return ref
    if ref.startswith("env:"):
        raise ValueError(f"env:{ref[4:]!r} needs an environment variable name, e.g. env:FEDFLEET_PASSWORD")
    if ref.startswith("file:"):
        raise ValueError("file: needs a path, e.g. file:/etc/fedfleet/password")
    raise ValueError("must be a reference like env:NAME or file:PATH, never the secret itself")


def resolve_secret(ref: str) -> str:
    """The secret ``ref`` points at: the variable's value, or the file's text without surrounding blanks."""
    kind, _, where = check_secret_ref(ref).partition(":")  # type: ignore[union-attr]
    if kind == "env":
        if where not in os.environ:
            raise SecretError(f"environment variable {where!r} is not set")
        return os.environ[where]
    path = Path(where).expanduser()
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise SecretError(f"cannot read {path}: {exc.strerror}") from None


_PARTITION = re.compile(r"^(?P<kind>iid|permuted_labels|dirichlet|domains)(\((?P<arg>[^)]*)\))?$")
_PARTITION_HELP = "use iid, permuted_labels, dirichlet(ALPHA > 0), domains or domains(N)"


class Partition(BaseModel):
    """How a data set is split over devices; written as text in both files (``dirichlet(0.5)``, ``domains(3)``).

    ``domains`` without a count is two domains. Validating text or a mapping gives the same model,
    and :attr:`text` writes it back in the form both files read.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["iid", "dirichlet", "permuted_labels", "domains"]
    alpha: PositiveFloat | None = None
    domains: PositiveInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        return parse_partition_text(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _arguments_fit_the_kind(self) -> Partition:
        if (self.kind == "dirichlet") != (self.alpha is not None):
            raise ValueError("alpha is required for dirichlet and only for dirichlet")
        if self.domains is not None and self.kind != "domains":
            raise ValueError(f"domains is a count for the domains partition only, not {self.kind}")
        if self.alpha is not None and not math.isfinite(self.alpha):
            raise ValueError(f"dirichlet alpha must be a finite number, got {self.alpha}")
        return self

    @property
    def text(self) -> str:
        if self.kind == "dirichlet":
            return f"dirichlet({self.alpha:g})"
        if self.kind == "domains" and self.domains is not None:
            return f"domains({self.domains})"
        return self.kind

    def spec(self, count: int, seed: int) -> PartitionSpec:
        """The split of a data set into ``count`` shares (at most one domain per share)."""
        if self.kind == "dirichlet":
            return PartitionSpec("dirichlet", count, seed, alpha=self.alpha)  # type: ignore[arg-type]
        if self.kind == "domains":
            return PartitionSpec("domains", count, seed, num_domains=min(self.domains or 2, count))
        return PartitionSpec("iid", count, seed, permute_labels=self.kind == "permuted_labels")


def parse_partition_text(text: str) -> dict[str, Any]:
    """The fields of a partition written as text; a ValueError names what is wrong with it."""
    match = _PARTITION.match(text.replace(" ", ""))
    if not match:
        raise ValueError(f"{text!r} is not a partition; {_PARTITION_HELP}")
    kind, arg = match["kind"], match["arg"]
    if kind == "dirichlet":
        if arg is None:
            raise ValueError("dirichlet needs its concentration alpha, e.g. dirichlet(0.5)")
        try:
            alpha = float(arg)
        except ValueError:
            raise ValueError(f"dirichlet alpha {arg!r} is not a number") from None
        if not alpha > 0:
            raise ValueError(f"dirichlet alpha must be > 0, got {arg}")
        return {"kind": kind, "alpha": alpha}
    if kind == "domains" and arg is not None:
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"domains({arg}): the number of domains must be a whole number >= 1")
        return {"kind": kind, "domains": int(arg)}
    if arg is not None:
        raise ValueError(f"{text!r}: {kind} takes no argument; {_PARTITION_HELP}")
    return {"kind": kind}


def parse_partition(text: str) -> Partition:
    """A partition from its text (``dirichlet(0.5)``); a ValueError says what is wrong."""
    return Partition(**parse_partition_text(text))
