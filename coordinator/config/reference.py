"""The fleet.yaml reference table, generated from the pydantic models' field descriptions.

The docs page holds the table between two marker comments; ``python -m coordinator.config.reference``
rewrites it, and a test fails when the committed page differs from what the models say, so the
reference cannot drift from the schema the coordinator validates against.

    python -m coordinator.config.reference            # rewrite docs/fleet-yaml.md
    python -m coordinator.config.reference --check    # exit 1 if the page is stale
"""

from __future__ import annotations

import argparse
import enum
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from coordinator.config.fleet import Fleet
from device_agent.common.schema import Partition

BEGIN = "<!-- fleet-reference:begin -->"
END = "<!-- fleet-reference:end -->"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "fleet-yaml.md"

# Models that fleet.yaml writes as one string rather than as a mapping of their fields.
_WRITTEN_AS_TEXT: dict[type[BaseModel], str] = {
    Partition: "`iid`, `dirichlet(ALPHA)`, `permuted_labels`, `domains` or `domains(N)`",
}


def _members(annotation: Any) -> list[Any]:
    """The alternatives of ``X | None`` / ``Optional[X]`` without ``None``; any other type alone."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return [annotation]


def _model_of(annotation: Any) -> tuple[type[BaseModel], bool] | None:
    """The nested model a field holds (and whether as a list), if fleet.yaml writes it as a mapping."""
    for member in _members(annotation):
        inner, is_list = (typing.get_args(member)[0], True) if typing.get_origin(member) is list else (member, False)
        if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in _WRITTEN_AS_TEXT:
            return inner, is_list
    return None


def type_text(annotation: Any) -> str:
    """A field's type as a reader of YAML sees it."""
    parts = []
    for member in _members(annotation):
        origin = typing.get_origin(member)
        if origin is Literal:
            parts.append(" \\| ".join(f"`{value}`" for value in typing.get_args(member)))
        elif origin is list:
            parts.append(f"list of {type_text(typing.get_args(member)[0])}")
        elif origin is dict:
            parts.append("mapping")
        elif member in _WRITTEN_AS_TEXT:
            parts.append(_WRITTEN_AS_TEXT[member])
        elif typing.get_origin(member) is typing.Annotated:
            parts.append(type_text(typing.get_args(member)[0]))
        elif isinstance(member, type) and member.__name__ == "ByteSize":
            parts.append("bytes (`256 MiB` or a number)")
        elif isinstance(member, type) and issubclass(member, Path):
            parts.append("path")
        elif isinstance(member, type) and issubclass(member, BaseModel):
            parts.append("mapping")
        elif isinstance(member, type):
            parts.append({"str": "text", "int": "integer", "float": "number", "bool": "boolean"}.get(member.__name__))
        else:
            parts.append(str(member))
    optional = type(None) in typing.get_args(annotation)
    return " \\| ".join(parts) + (" or `null`" if optional else "")


def default_text(field: FieldInfo) -> str:
    """The default as YAML would write it; *required* when there is none."""
    if field.is_required():
        return "*required*"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "*required*"
    if isinstance(value, BaseModel):
        return f"`{value.text}`" if isinstance(value, Partition) else "see below"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, list | dict) and not value:
        return "`[]`" if isinstance(value, list) else "`{}`"
    return f"`{value}`"


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    """One table row per field, nested models expanded under their key (``devices[].overrides.memory.total``)."""
    out = []
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)  # what fleet.yaml spells: `async`, a Python keyword, is an alias
        nested = _model_of(field.annotation)
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        if nested is None:
            out.append(f"| `{key}` | {type_text(field.annotation)} | {default_text(field)} | {description} |")
            continue
        child, is_list = nested
        kind = "list of mappings" if is_list else "mapping"
        out.append(f"| `{key}` | {kind} | {default_text(field)} | {description} |")
        out += rows(child, key + ("[]." if is_list else "."))
    return out


def render() -> str:
    """The reference table between its markers."""
    return "\n".join(
        [
            BEGIN,
            "<!-- generated by `make docs-reference` (coordinator/config/reference.py): do not edit by hand -->",
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
            *rows(Fleet),
            END,
        ]
    )


def replace_reference(text: str, table: str) -> str:
    """``text`` with everything from the begin marker to the end marker replaced by ``table``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {BEGIN} ... {END} markers to put the reference between")
    return text[:start] + table + text[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.config.reference", description="write the fleet.yaml reference into its docs page"
    )
    parser.add_argument("--page", type=Path, default=PAGE, help="page to update (default: docs/fleet-yaml.md)")
    parser.add_argument("--check", action="store_true", help="only check: exit 1 when the page is stale")
    args = parser.parse_args(argv)
    try:
        current = args.page.read_text()
        fresh = replace_reference(current, render())
    except (OSError, ValueError) as exc:
        print(f"reference: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if fresh != current:
            print(f"{args.page} is stale: run `make docs-reference`", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(fresh)
    print(f"updated {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
