"""Cheap bounds on raw JSON bytes, checked before ``json.loads`` ever sees them.

``json.loads`` recurses once per nesting level, so a few kilobytes of ``[[[[...`` raise
``RecursionError`` (not a ``ValueError``) deep inside whichever handler parses them. Measuring the
bracket depth first, in time linear in the size and without a Python-level loop per byte, lets the
parser refuse such a message with a clear error instead.
"""

from __future__ import annotations

import re

import numpy as np

# A JSON string once its escaped backslashes and quotes are gone (brackets inside strings do not
# nest). The closing quote is optional so that an unterminated string still matches, to the end: a
# pattern that can fail makes the regex engine retry from every later quote, which is quadratic.
_STRING = re.compile(rb'"[^"]*"?')
_OPEN_CLOSE = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def nesting_depth(data: bytes) -> int:
    """The deepest bracket nesting of ``data`` outside strings.

    For malformed JSON the count is an upper bound on how deep a parser gets before it stops at the
    error (up to the first error, openers minus closers is exactly its depth).
    """
    # Escapes first, by plain replacement: inside a string every backslash run starts on an escape,
    # and a backslash outside one is where any parser stops, so what follows it cannot matter.
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    steps = _STRING.sub(b"", unescaped).translate(_OPEN_CLOSE, _NOT_BRACKETS)
    if not steps:
        return 0
    return max(0, int(np.cumsum(np.frombuffer(steps, dtype=np.int8), dtype=np.int64).max()))
