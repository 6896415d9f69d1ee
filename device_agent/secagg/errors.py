"""What goes wrong in secure aggregation, by kind: bad parameters, bad input values, a broken protocol, an abort."""

from __future__ import annotations


class SecAggError(Exception):
    """Base of every secure-aggregation error."""


class ParameterError(SecAggError, ValueError):
    """A secure-aggregation parameter out of its range; the message names the parameter."""


class QuantizationError(SecAggError, ValueError):
    """An input outside the quantization range, not finite, or a sum that overflowed the modulus."""


class ProtocolViolation(SecAggError):
    """A message out of order, from the wrong party, forged, replayed or contradicting an earlier one."""


class ProtocolAborted(SecAggError):
    """Too few devices remain to finish the round's protocol; ``stage`` says where it stopped.

    ``device`` and ``count``, where set, name the device whose masks could not be removed and how many of its
    neighbours could help (fewer than the threshold).
    """

    def __init__(self, stage: str, message: str, device: str | None = None, count: int | None = None) -> None:
        super().__init__(f"secure aggregation aborted at {stage}: {message}")
        self.stage, self.device, self.count = stage, device, count
