"""How a pydantic validation error reads to a person: every problem with the key path that caused it."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError


def describe(
    exc: ValidationError,
    prefix: str = "",
    empty: str = "(top level)",
    sep: str = "; ",
    model: type[BaseModel] | None = None,
) -> str:
    """``devices[3].profile: ...`` for each problem, joined by ``sep``; ``empty`` names a problem with no key.

    pydantic's ``Value error, `` prefix is dropped: it says what kind of error, which nobody asked.
    With ``model`` (the one that was validated), an unknown key gets the closest known one of its
    mapping: ``broker.hots: Extra inputs are not permitted (did you mean 'host'?)``.
    """
    lines = []
    for error in exc.errors():
        path = prefix
        for part in error["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        message = error["msg"].removeprefix("Value error, ")
        if model is not None and error["type"] == "extra_forbidden" and error["loc"]:
            message += did_you_mean(str(error["loc"][-1]), keys_at(model, error["loc"][:-1]))
        lines.append(f"{path or empty}: {message}")
    return sep.join(lines)


def with_hints(exc: ValidationError, model: type[BaseModel]) -> ValidationError:
    """``exc`` (of validating ``model``) with :func:`describe`'s did-you-mean in its messages.

    For a validator that validates a nested model itself (a strategy's ``params``): pydantic moves the
    errors it raises under the field's key, where the outer model's fields say nothing about the keys.
    """
    details: list[InitErrorDetails] = []
    for error in exc.errors():
        hint = ""
        if error["type"] == "extra_forbidden" and error["loc"]:
            hint = did_you_mean(str(error["loc"][-1]), keys_at(model, error["loc"][:-1]))
        kind = PydanticCustomError("extra_forbidden", error["msg"] + hint) if hint else error["type"]
        details.append({"type": kind, "loc": error["loc"], "input": error["input"], **_ctx(error)})
    return ValidationError.from_exception_data(exc.title, details)


def _ctx(error: Any) -> dict[str, Any]:
    return {"ctx": error["ctx"]} if "ctx" in error else {}


def did_you_mean(key: str, known: Sequence[str]) -> str:
    """`` (did you mean 'host'?)`` when a known key is close to ``key``, else nothing."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def keys_at(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The keys the mapping at ``loc`` of ``model``'s input may have (a union's models together).

    Follows fields through optionals, unions, lists and dicts; a part that is no field (a list index,
    a dict key, pydantic's name of a union member) narrows to the member it names or is passed over.
    """
    models = [model]
    for part in loc:
        if isinstance(part, int):
            continue
        named = [m for m in models if m.__name__ == part]
        if named:
            models = named
            continue
        fields = [field for m in models for name, field in m.model_fields.items() if part in (name, field.alias)]
        if fields:
            models = [found for field in fields for found in _models_in(field.annotation)]
    return sorted({field.alias or name for m in models for name, field in m.model_fields.items()})


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation can hold, looking through Optional, unions, lists and dicts."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = get_args(annotation)
    if get_origin(annotation) is Annotated:
        args = args[:1]
    return [found for arg in args for found in _models_in(arg)]


__all__ = ["describe", "did_you_mean", "keys_at", "with_hints"]
