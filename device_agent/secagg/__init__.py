"""Secure aggregation (SecAgg+, Bell et al. 2020, on the protocol of Bonawitz et al. 2017), sans-IO.

The coordinator learns the sum of the surviving devices' updates and nothing else about any one of them:
each device adds to its quantized update pairwise masks that cancel in the sum and a self-mask the
coordinator removes with the seed's shares, recovered from the device's neighbours. See
docs/secure-aggregation.md. Needs the ``cryptography`` package (the ``secagg`` extra), imported on first use.
"""

from device_agent.secagg.device import DeviceProtocol
from device_agent.secagg.errors import (
    ParameterError,
    ProtocolAborted,
    ProtocolViolation,
    QuantizationError,
    SecAggError,
)
from device_agent.secagg.messages import Params, Session
from device_agent.secagg.server import Aggregate, LateMessage, ServerProtocol

__all__ = [
    "Aggregate",
    "DeviceProtocol",
    "LateMessage",
    "ParameterError",
    "Params",
    "ProtocolAborted",
    "ProtocolViolation",
    "QuantizationError",
    "SecAggError",
    "ServerProtocol",
    "Session",
]
