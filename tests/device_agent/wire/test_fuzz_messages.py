"""Property: whatever bytes arrive on a topic, parse_message returns a message or raises ProtocolError."""

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from device_agent.wire.json_bounds import nesting_depth
from device_agent.wire.messages import (
    MAX_MESSAGE_BYTES,
    MAX_NESTING,
    Ack,
    Assignment,
    Manifest,
    Nack,
    ProtocolError,
    Status,
    encode,
    parse_message,
)

FUZZ = settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
TRANSFER = "0" * 32

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
message_types = st.sampled_from(
    ["hello", "assignment", "manifest", "ack", "nack", "status", "error", "receipt", "round_failed", "other"]
)


def _parses_or_refuses(data: bytes) -> None:
    try:
        parse_message(data)
    except ProtocolError as exc:
        assert str(exc)


@FUZZ
@given(st.binary(max_size=512))
@example(b"[" * 100_000)
@example(b'{"v": 3, "type": "ack", "transfer": ' + b"[" * 50_000)
@example(b'{"v": 3, "x": ' + b"1" * 5000 + b"}")
@example(b'{"v": ' + b"9" * 5000 + b"}")
@example(b"\x00\x00\x00{")
def test_arbitrary_bytes_parse_or_raise_protocol_error(data):
    _parses_or_refuses(data)


@pytest.mark.slow
@FUZZ
@given(message_types, st.dictionaries(st.text(max_size=12), json_values, max_size=8))
def test_json_objects_with_a_type_parse_or_raise_protocol_error(kind, fields):
    _parses_or_refuses(json.dumps({"v": 3, "type": kind, **fields}).encode())


@FUZZ
@given(st.integers(0, 2**70), st.integers(-5, 2**70), st.lists(st.integers(-1, 2**40), max_size=6))
def test_manifest_and_nack_numbers_parse_or_raise_protocol_error(size, chunk_size, missing):
    manifest = {"v": 3, "type": "manifest", "transfer": TRANSFER, "size": size, "chunk_size": chunk_size}
    _parses_or_refuses(json.dumps(manifest).encode())
    _parses_or_refuses(json.dumps({"v": 3, "type": "nack", "transfer": TRANSFER, "missing": missing}).encode())


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 10_000, 500_000])
def test_a_nesting_bomb_is_refused_before_json_parses_it(depth):
    bomb = b'{"v": 3, "type": "status", "detail": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(ProtocolError, match=f"nested deeper than {MAX_NESTING} levels"):
        parse_message(bomb[:MAX_MESSAGE_BYTES])


def test_brackets_inside_strings_do_not_count_as_nesting():
    detail = '[{"' * 200 + '\\"]'
    status = Status(device="dev-a", state="idle", detail=detail)
    assert parse_message(encode(status)) == status
    assert nesting_depth(b'{"a": "[[[[\\"[[[", "b": [[1]]}') == 3


def test_each_message_kind_has_its_own_size_limit():
    padded = json.dumps({"v": 3, "type": "status", "device": "a", "state": "idle", "detail": "x" * (40 << 10)})
    with pytest.raises(ProtocolError, match=r"'status' message of \d+ bytes exceeds its 32768-byte limit"):
        parse_message(padded.encode())
    many = Nack(transfer=TRANSFER, missing=list(range(60_000)))
    assert parse_message(encode(many)) == many
    with pytest.raises(ProtocolError, match="exceeds the 1048576-byte limit"):
        parse_message(b" " * (MAX_MESSAGE_BYTES + 1))


def test_valid_messages_still_round_trip():
    for message in (
        Ack(transfer=TRANSFER, digest="a" * 64),
        Manifest(transfer=TRANSFER, size=10, chunk_size=4, chunks=["b" * 64] * 3, digest="c" * 64),
    ):
        assert parse_message(encode(message)) == message


ASSIGNMENT = {
    "v": 3,
    "type": "assignment",
    "run": "run-1",
    "round": 1,
    "deadline_s": 60.0,
    "download": TRANSFER,
    "spec": {
        "strategy": "fedhm",
        "model": {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8},
        "level": 0.5,
        "frobenius_decay": 1e-3,
        "send_classes": False,
    },
    "train": {"optimizer": "momentum", "lr": 0.05, "epochs": 1, "batch_size": 32, "seed": 0},
}
PATHS = [(), ("spec",), ("spec", "model"), ("train",)]


@pytest.mark.slow
@FUZZ
@given(
    st.lists(
        st.tuples(st.sampled_from(PATHS), st.text(max_size=15) | st.sampled_from(["strategy", "arch", "level", "lr"])),
        min_size=1,
        max_size=3,
    ),
    st.lists(json_values | st.sampled_from(["fedavg", "fedlora", "resnet18", -1, 0, 2**64, "nan"]), min_size=3),
)
def test_assignments_with_altered_fields_parse_or_raise_protocol_error(changes, values):
    assert isinstance(parse_message(json.dumps(ASSIGNMENT).encode()), Assignment)  # the unaltered one is valid
    message = json.loads(json.dumps(ASSIGNMENT))
    for (path, key), value in zip(changes, values, strict=False):
        node = message
        for step in path:
            node = node[step]
        node[key] = value
    _parses_or_refuses(json.dumps(message).encode())
