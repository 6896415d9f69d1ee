"""How a pydantic validation error reads to a person: every problem with the key path that caused it."""

from __future__ import annotations

from pydantic import ValidationError


def describe(exc: ValidationError, prefix: str = "", empty: str = "(top level)", sep: str = "; ") -> str:
    """``devices[3].profile: ...`` for each problem, joined by ``sep``; ``empty`` names a problem with no key.

    pydantic's ``Value error, `` prefix is dropped: it says what kind of error, which nobody asked.
    """
    lines = []
    for error in exc.errors():
        path = prefix
        for part in error["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        lines.append(f"{path or empty}: {error['msg'].removeprefix('Value error, ')}")
    return sep.join(lines)


__all__ = ["describe"]
