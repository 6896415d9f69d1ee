"""No class in device_agent/wire grows past 300 lines: the session became a god object once (716 lines)."""

import ast
from pathlib import Path

import device_agent.wire

MAX_CLASS_LINES = 300
WIRE = Path(device_agent.wire.__file__).parent


def class_sizes() -> dict[str, int]:
    """Lines of every class in the wire package (decorators excluded), by ``module.py:Class``."""
    sizes = {}
    for path in sorted(WIRE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.relative_to(WIRE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


def test_no_class_in_the_wire_package_is_over_300_lines():
    sizes = class_sizes()
    assert "session.py:Session" in sizes and "engine/core.py:TransferEngine" in sizes  # the walk sees both layers
    too_big = {name: lines for name, lines in sizes.items() if lines > MAX_CLASS_LINES}
    assert too_big == {}, f"split these classes (at most {MAX_CLASS_LINES} lines each): {too_big}"
