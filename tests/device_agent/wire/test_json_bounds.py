"""nesting_depth: exact on JSON, an upper bound on how deep a parser gets in malformed JSON, linear time."""

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from device_agent.wire.json_bounds import nesting_depth

FUZZ = settings(max_examples=200)
values = st.recursive(
    st.none() | st.integers() | st.text(alphabet='[]{}"\\ab', max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text('[{"\\}]', max_size=3), children),
    max_leaves=30,
)


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@pytest.mark.slow
@FUZZ
@given(values)
def test_depth_of_json_text_is_the_depth_of_its_value(value):
    assert nesting_depth(json.dumps(value).encode()) == _depth(value)


@FUZZ
@given(st.binary(max_size=64) | st.text(alphabet='[]{}"\\,1 ', max_size=64).map(str.encode))
@example(b'"' + b'\\"' * 300_000)  # an unterminated string of escaped quotes: was quadratic (minutes)
@example(b"[" * 300_000)
@example(b']"[' + b"[" * 50)
@example(b'\\""[')  # a stray backslash: the parser stops there, before the '['
def test_no_parser_gets_deeper_than_the_bound(data):
    bound = nesting_depth(data)
    # Walk the bytes as a JSON parser does, up to where it would stop at an unmatched closer.
    depth = 0
    in_string = escaped = False
    for byte in data[:5000]:
        char = chr(byte)
        if in_string:
            escaped, in_string = (not escaped and char == "\\"), in_string and (escaped or char != '"')
            continue
        if char == "\\":
            break  # a parser stops at a backslash outside a string
        if char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            assert depth <= bound
        elif char in "]}":
            if depth == 0:
                break  # a parser stops at an unmatched closer
            depth -= 1
