import base64
import json

import pytest

from device_agent.wire.messages import (
    PROTOCOL_VERSION,
    Ack,
    Error,
    Hello,
    Manifest,
    ProtocolError,
    SecAgg,
    Status,
    VersionMismatch,
    encode,
    incompatible,
    parse_message,
    refuses_version,
)
from tests.device_profiles import reported_profile

PROFILE = reported_profile()


def test_messages_round_trip_through_json():
    hello = Hello(device="dev-a", agent_version="0.1.0", profile=PROFILE)
    assert parse_message(encode(hello)) == hello
    status = Status(device="dev-a", state="training", detail="round 3")
    assert parse_message(encode(status)) == status


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"type": "ack"}', "missing protocol version"),
        (b'{"v": 1, "type": "ack"}', "unsupported protocol version 1"),
        (b'{"v": 3, "type": "teleport"}', "type"),
        (b'{"v": 3, "type": "ack", "transfer": "xyz", "digest": "00"}', "transfer"),
        (b'{"v": 3, "type": "status", "device": "a", "state": "online", "colour": "red"}', "colour"),
        (b'{"v": 3, "type": "status", "device": "a", "state": "online", "sent_at": Infinity}', "sent_at"),
        (b'{"v": 3, "type": "status", "device": "a", "state": "online", "sent_at": 1e300}', "sent_at"),
        (b'{"v": 3, "type": "status", "device": "a", "state": "online", "sent_at": -1}', "sent_at"),
    ],
)
def test_bad_messages_are_refused_with_the_problem_named(raw, problem):
    with pytest.raises(ProtocolError, match=problem):
        parse_message(raw)


def test_device_names_cannot_carry_topic_wildcards():
    with pytest.raises(ProtocolError, match="device"):
        parse_message(json.dumps({"v": 3, "type": "status", "device": "a/+/b", "state": "online"}))


def test_a_manifest_whose_chunk_count_disagrees_with_its_size_is_refused():
    digest = "0" * 64
    with pytest.raises(ValueError, match="expected 3"):
        Manifest(transfer="a" * 32, size=10, chunk_size=4, chunks=[digest], digest=digest)
    ack = Ack(transfer="a" * 32, digest=digest)
    assert parse_message(encode(ack)).digest == digest


def test_an_incompatible_error_is_read_whatever_version_sent_it() -> None:
    newer = b'{"v": 4, "type": "error", "code": "incompatible", "detail": "speak 4", "new_field": 1}'
    answer = parse_message(newer)
    assert isinstance(answer, Error) and (answer.code, answer.detail) == ("incompatible", "speak 4")
    with pytest.raises(VersionMismatch) as info:
        parse_message(b'{"v": 4, "type": "hello"}')
    assert info.value.version == 4
    assert "(this side speaks 3)" in incompatible(4).detail


def test_an_incompatible_answer_says_whether_it_is_about_this_side_s_version() -> None:
    assert refuses_version(incompatible(PROTOCOL_VERSION))
    assert not refuses_version(incompatible(2)) and not refuses_version(incompatible("3"))
    assert not refuses_version(Error(code="rejected", detail=incompatible(PROTOCOL_VERSION).detail))


def test_a_secure_aggregation_message_carries_its_protocol_bytes_as_base64() -> None:
    body = base64.b64encode(bytes(range(256)) * 2000).decode()  # ~680 KB: a masked input of 128k values
    message = SecAgg(run="run-1", round=3, body=body)

    parsed = parse_message(encode(message))

    assert isinstance(parsed, SecAgg) and base64.b64decode(parsed.body) == bytes(range(256)) * 2000
    with pytest.raises(ProtocolError, match="body"):
        parse_message(encode(message).replace(b'"body":"', b'"body":"{'))
    with pytest.raises(ProtocolError, match="exceeds"):
        parse_message(encode(SecAgg(run="run-1", round=3, body="A" * (1 << 20))))


def test_a_secure_aggregation_weight_is_a_fraction_in_0_1() -> None:
    assert parse_message(encode(SecAgg(run="r", round=1, body="AAAA", weight=0.25))).weight == 0.25  # type: ignore[union-attr]
    plain = encode(SecAgg(run="r", round=1, body="AAAA"))
    for weight in (b"0.0", b"1.5"):
        with pytest.raises(ProtocolError, match="weight"):
            parse_message(plain.replace(b'"weight":null', b'"weight":' + weight))
