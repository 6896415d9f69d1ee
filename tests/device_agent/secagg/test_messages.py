"""Messages: wire form, canonical bytes, signatures, and the server's and device's checks on what arrives."""

import dataclasses

import pytest

from device_agent.secagg.auth import HmacAuth, signed
from device_agent.secagg.device import DeviceProtocol
from device_agent.secagg.errors import ParameterError, ProtocolAborted, ProtocolViolation
from device_agent.secagg.messages import (
    AdvertiseKeys,
    EncryptedShares,
    MaskedInput,
    Params,
    Session,
    UnmaskResponse,
    decode,
    encode,
)
from device_agent.secagg.server import LateMessage, ServerProtocol
from tests.device_agent.secagg.conftest import devices

KEYS = {device: bytes([i + 1]) * 32 for i, device in enumerate(devices(4))}


@pytest.fixture
def params():
    return Params(devices(4), threshold=2, neighbours=3, length=5, clip=1.0, bits=8)


def _advertised(session, params):
    """A server with every device's keys in, and the devices that sent them."""
    server = ServerProtocol(session, params, HmacAuth(KEYS))
    protocols = {d: DeviceProtocol(d, HmacAuth({d: KEYS[d]})) for d in params.participants}
    for setup in server.start():
        server.receive(protocols[setup.recipient].advertise(setup))
    return server, protocols


def test_every_message_survives_its_wire_form(session, params):
    server, protocols = _advertised(session, params)
    neighbour_keys = server.advance()
    shares = [protocols[m.recipient].share_keys(m) for m in neighbour_keys]
    for message in shares:
        server.receive(message)
    forwarded = server.advance()
    masked = [protocols[m.recipient].mask(m, [0.5] * 5) for m in forwarded]
    for message in [*server.start(), *neighbour_keys, *shares, *forwarded, *masked]:
        assert decode(encode(message)) == message
    response = UnmaskResponse(session, "dev-01", (("dev-02", b"\x01" * 33),), ())
    assert decode(encode(response)) == response
    # Bulk bytes travel raw after the header: a masked input is its vector plus a small fixed overhead.
    assert len(encode(masked[0])) - len(masked[0].masked) < 300


TRUNCATED = encode(MaskedInput(Session("f", "r", 1), "d", b"ab"))[:-1]


@pytest.mark.parametrize("data", [b"", b"\x00\x00\x00\x05{]}xx", TRUNCATED])
def test_malformed_wire_bytes_are_a_protocol_violation(data):
    with pytest.raises(ProtocolViolation, match="malformed"):
        decode(data)


def test_signed_bytes_cover_every_field_and_the_vector_by_digest(session):
    message = MaskedInput(session, "dev-01", b"\x00" * 64)
    assert message.signed_bytes() != dataclasses.replace(message, masked=b"\x00" * 63 + b"\x01").signed_bytes()
    assert message.signed_bytes() != dataclasses.replace(message, sender="dev-02").signed_bytes()
    later = dataclasses.replace(message, session=Session("fleet", "run-1", 4))
    assert message.signed_bytes() != later.signed_bytes()
    assert len(message.signed_bytes()) < 200  # the digest, not the vector
    assert message.signed_bytes() == dataclasses.replace(message, signature="anything").signed_bytes()


def test_server_refuses_forged_replayed_and_misaddressed_messages(session, params):
    server = ServerProtocol(session, params, HmacAuth(KEYS))
    honest = DeviceProtocol("dev-01", HmacAuth({"dev-01": KEYS["dev-01"]}))
    setups = {setup.recipient: setup for setup in server.start()}
    keys = honest.advertise(setups["dev-01"])
    forged = signed(dataclasses.replace(keys, mask_key=b"\x07" * 32), HmacAuth({"dev-01": b"\xee" * 32}))
    with pytest.raises(ProtocolViolation, match="signature of a message of 'dev-01' does not verify"):
        server.receive(forged)
    replayed = signed(dataclasses.replace(keys, session=Session("fleet", "run-1", 2)), HmacAuth(KEYS))
    with pytest.raises(ProtocolViolation, match="of session"):
        server.receive(replayed)
    with pytest.raises(ProtocolViolation, match="from intruder, not expected"):
        server.receive(AdvertiseKeys(session, "intruder", b"\x01" * 32, b"\x02" * 32))
    server.receive(keys)
    server.receive(keys)  # the same message again (a QoS 1 redelivery) is harmless
    other = signed(dataclasses.replace(keys, share_key=b"\x03" * 32), HmacAuth(KEYS))
    with pytest.raises(ProtocolViolation, match="two different advertise_keys"):
        server.receive(other)
    with pytest.raises(LateMessage, match="encrypted_shares from dev-01 at stage advertise keys"):
        server.receive(signed(EncryptedShares(session, "dev-01", ()), HmacAuth(KEYS)))


def test_device_refuses_messages_not_signed_with_its_key_or_not_for_it(session, params):
    server = ServerProtocol(session, params, HmacAuth({d: b"\x55" * 32 for d in params.participants}))
    setups = {setup.recipient: setup for setup in server.start()}
    device = DeviceProtocol("dev-01", HmacAuth({"dev-01": KEYS["dev-01"]}))
    with pytest.raises(ProtocolViolation, match="does not verify"):
        device.advertise(setups["dev-01"])
    with pytest.raises(ProtocolViolation, match="setup for dev-02 delivered to dev-01"):
        device.advertise(setups["dev-02"])


def test_server_checks_shares_go_to_exactly_the_neighbours(session, params):
    server, protocols = _advertised(session, params)
    message = next(m for m in server.advance() if m.recipient == "dev-00")
    shares = protocols["dev-00"].share_keys(message)
    short = signed(dataclasses.replace(shares, shares=shares.shares[1:]), HmacAuth(KEYS))
    with pytest.raises(ProtocolViolation, match="dev-00 sent shares to"):
        server.receive(short)


def test_params_name_what_is_wrong():
    with pytest.raises(ParameterError, match="sorted order"):
        Params(("b", "a", "c"), threshold=2, neighbours=2, length=1, clip=1.0, bits=8)
    with pytest.raises(ParameterError, match=r"^threshold"):
        Params(devices(5), threshold=5, neighbours=4, length=1, clip=1.0, bits=8)
    with pytest.raises(ParameterError, match=r"^length"):
        Params(devices(5), threshold=2, neighbours=4, length=0, clip=1.0, bits=8)
    with pytest.raises(ParameterError, match=r"^clip"):
        Params(devices(5), threshold=2, neighbours=4, length=1, clip=-1.0, bits=8)


def test_a_redelivered_masked_input_counts_once_and_a_different_one_is_refused(session, params):
    server, protocols = _advertised(session, params)
    for message in server.advance():
        server.receive(protocols[message.recipient].share_keys(message))
    masked = {m.recipient: protocols[m.recipient].mask(m, [0.25] * 5) for m in server.advance()}
    for message in masked.values():
        server.receive(message)
        server.receive(decode(encode(message)))  # a QoS 1 redelivery of the same message
    altered = signed(dataclasses.replace(masked["dev-00"], masked=bytes(20)), HmacAuth(KEYS))
    with pytest.raises(ProtocolViolation, match="dev-00 sent two different masked_input"):
        server.receive(altered)
    for message in server.advance():
        server.receive(protocols[message.recipient].unmask(message))
    server.advance()
    assert server.result is not None and server.result.total == pytest.approx([1.0] * 5, abs=server.result.error_bound)


def test_device_takes_neighbour_keys_from_its_own_neighbourhood_only(session):
    params = Params(devices(7), threshold=3, neighbours=4, length=3, clip=1.0, bits=8)
    server = ServerProtocol(session, params)
    protocols = {d: DeviceProtocol(d) for d in params.participants}
    for setup in server.start():
        server.receive(protocols[setup.recipient].advertise(setup))
    message = next(m for m in server.advance() if m.recipient == "dev-00")
    stranger = next(d for d in params.participants if d not in server.graph["dev-00"] and d != "dev-00")
    foreign = dataclasses.replace(message, keys=(*message.keys[:-1], (stranger, b"\x01" * 32, b"\x02" * 32)))
    with pytest.raises(ProtocolViolation, match=rf"\['{stranger}'\] are not neighbours dev-00"):
        protocols["dev-00"].share_keys(foreign)
    too_few = dataclasses.replace(message, keys=message.keys[:2])
    with pytest.raises(ProtocolAborted, match="2 of dev-00's neighbours advertised keys, threshold 3"):
        protocols["dev-00"].share_keys(too_few)
