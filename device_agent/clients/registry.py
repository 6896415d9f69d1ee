"""Client programs by strategy name: this package's modules, and ``fedfleet.clients`` entry points.

A program registers itself under every name of its spec's ``strategy`` literal when its class is
defined (:class:`~device_agent.clients.base.ClientProgram`); an assignment's spec is parsed into
the class registered for its ``strategy`` (:func:`~device_agent.clients.spec.parse_spec`).
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from device_agent.common.registry import Registry

ENTRY_POINT_GROUP = "fedfleet.clients"

PROGRAMS: Registry[Any] = Registry("client program", "device_agent.clients", ENTRY_POINT_GROUP)
"""strategy name -> the ClientProgram class that trains it (its ``Spec`` is the spec class)."""


def literal_names(spec_type: type) -> tuple[str, ...]:
    """The strategy names a spec class serves (its ``strategy: Literal[...]``); () for an abstract spec."""
    field = getattr(spec_type, "model_fields", {}).get("strategy")
    annotation = getattr(field, "annotation", None)
    return tuple(get_args(annotation)) if get_origin(annotation) is Literal else ()


__all__ = ["ENTRY_POINT_GROUP", "PROGRAMS", "literal_names"]
