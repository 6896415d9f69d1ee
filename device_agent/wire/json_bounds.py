"""Cheap bounds on raw JSON bytes, checked before ``json.loads`` ever sees them.

``json.loads`` recurses once per nesting level, so a few kilobytes of ``[[[[...`` raise
``RecursionError`` (not a ``ValueError``) deep inside whichever handler parses them. Scanning the
bytes for bracket depth first costs one regex pass and lets the parser refuse such a message with
a clear error instead.
"""

from __future__ import annotations

import re

# A JSON string, escapes included: brackets inside strings do not nest. DOTALL so an escaped
# newline byte cannot stop the match and make the scan backtrack.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")
_OPENING = frozenset(b"[{")


def nesting_depth(data: bytes, limit: int) -> int:
    """The deepest bracket nesting of ``data`` outside strings, counted up to ``limit + 1`` and no further.

    Malformed JSON gets a number too (unbalanced closers count as nothing): the parser refuses it
    later with its own message; this scan only has to keep the parser's recursion bounded.
    """
    depth = deepest = 0
    for match in _BRACKETS.finditer(_STRING.sub(b"", data)):
        if match.group()[0] in _OPENING:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif depth:
            depth -= 1
    return deepest
