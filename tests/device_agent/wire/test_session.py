"""Sessions against real brokers: the mosquitto and amqtt started by tests/transport_fixtures.py."""

import hashlib
import logging
import os
import socket
import sys
import threading
import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from device_agent.wire.session import (
    BrokerAddress,
    LoginRefused,
    Session,
    SessionConfig,
    coordinator_session,
    device_session,
)
from device_agent.wire.topics import fleet_uplinks
from device_agent.wire.transfer import (
    DEFAULT_CHUNK_SIZE,
    Limits,
    PayloadTooLarge,
    TransferError,
    is_chunk_frame,
    make_manifest,
    parse_chunk_frame,
)
from tests.transport_fixtures import DEVICES
from tests.waiting import until


class Inbox:
    """Collects what a session hands to its handlers."""

    def __init__(self):
        self.payloads, self.messages = [], []
        self.arrived = threading.Event()

    def on_payload(self, topic, completed):
        self.payloads.append((topic, completed))
        self.arrived.set()

    def on_message(self, topic, message):
        self.messages.append((topic, message))


def pair(broker, device="dev-a", protocol="5", session_class=Session, **config):
    """A started coordinator session and device session, plus the device's inbox and topics."""
    inbox = Inbox()
    dev, topics = device_session(
        broker.fleet,
        device,
        broker.address(device),
        on_message=inbox.on_message,
        on_payload=inbox.on_payload,
        protocol=protocol,
        **config,
    )
    coord = session_class(
        SessionConfig(client_id="test-coordinator", broker=broker.address(), protocol=protocol, **config),
        subscriptions=[fleet_uplinks(broker.fleet)],
    )
    dev.start()
    coord.start()
    return coord, dev, inbox, topics


@pytest.mark.slow
def test_45_mib_arrive_bit_exact_on_mosquitto(mosquitto):
    coord, dev, inbox, topics = pair(mosquitto)
    try:
        payload = os.urandom(45 * 2**20)
        coord.send(topics.down, payload, round=3).wait(120)
        assert inbox.arrived.wait(60)
        [(topic, completed)] = inbox.payloads
        assert topic == topics.down and completed.manifest.round == 3
        assert hashlib.sha256(completed.data).digest() == hashlib.sha256(payload).digest()
    finally:
        coord.stop()
        dev.stop()


@pytest.mark.slow
def test_a_transfer_survives_a_broker_crash_and_restart_in_the_middle(fresh_mosquitto):
    coord, dev, inbox, topics = pair(fresh_mosquitto, reconnect_min_s=1, reconnect_max_s=2)
    try:
        payload = os.urandom(30 * 2**20)
        delivery = coord.send(topics.down, payload)
        deadline = time.monotonic() + 60
        while not dev.receiving() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert dev.receiving() == [delivery.transfer], "the transfer never started"
        fresh_mosquitto.broker.kill()
        assert not delivery.done
        fresh_mosquitto.broker.start()
        delivery.wait(120)
        assert inbox.arrived.wait(60)
        assert [c.data == payload for _, c in inbox.payloads] == [True]
        assert coord.stats.connects >= 2 and dev.stats.connects >= 2
    finally:
        coord.stop()
        dev.stop()


class FaultySession(Session):
    """Mangles the first transmission of some chunks: drops, duplicates, delays (reorders) and corrupts them."""

    seen: set
    held: list

    def _publish(self, topic, data, retain=False, transfer=None, windowed=False):
        if not is_chunk_frame(data):
            return super()._publish(topic, data, retain, transfer, windowed)
        _, index, _, _ = parse_chunk_frame(data)
        first = index not in self.seen
        self.seen.add(index)
        fault = index % 5 if first else None
        if fault == 0:
            if windowed:
                self.window.settle(len(data))  # lost on the wire after the broker took it
            return None
        if fault == 1:
            super()._publish(topic, data, retain, transfer)  # duplicated
        if fault == 2:
            self.held.append((data, windowed))  # sent after the next chunk: reordered
            return None
        if fault == 3:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])  # corrupted
        super()._publish(topic, data, retain, transfer, windowed)
        for late, late_windowed in self.held:
            super()._publish(topic, late, retain, transfer, late_windowed)
        self.held.clear()
        return None


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_loss_duplication_reordering_and_corruption_are_all_repaired(mosquitto, protocol):
    coord, dev, inbox, topics = pair(
        mosquitto, protocol=protocol, session_class=FaultySession, nack_after_s=0.3, chunk_size=16 * 1024
    )
    coord.seen, coord.held = set(), []
    try:
        payload = os.urandom(40 * 16 * 1024 + 123)
        coord.send(topics.down, payload).wait(60)
        assert inbox.arrived.wait(60)
        assert [c.data == payload for _, c in inbox.payloads] == [True]
        stats = dev.receivers.peers[topics.up].stats  # keyed by where its transfers are answered
        assert stats.corrupt >= 8 and stats.duplicates >= 8 and stats.nacks >= 1
    finally:
        coord.stop()
        dev.stop()


def test_an_oversize_payload_is_refused_before_anything_is_published(mosquitto):
    coord, dev, inbox, topics = pair(mosquitto, limits=Limits(max_payload_bytes=1 << 20))
    # Chunks the broker's max_packet_size (8 MiB in the fixture) cannot carry are refused as well.
    big_chunks = coordinator_session(mosquitto.fleet, mosquitto.address(), chunk_size=16 << 20)
    try:
        with pytest.raises(PayloadTooLarge, match="exceeds the 1048576-byte transfer limit; nothing was sent"):
            coord.send(topics.down, os.urandom((1 << 20) + 1))
        with pytest.raises(PayloadTooLarge, match="over the broker's 8388608-byte maximum packet size"):
            big_chunks.send(topics.down, os.urandom(20 << 20))
        time.sleep(0.5)
        assert dev.receiving() == [] and inbox.payloads == []
    finally:
        coord.stop()
        dev.stop()


@pytest.mark.slow
def test_malformed_and_unknown_version_messages_are_logged_and_the_session_carries_on(mosquitto, caplog):
    coord, dev, inbox, topics = pair(mosquitto)
    raw = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="test-raw-coordinator")
    address = mosquitto.address()
    raw.username_pw_set(address.username, address.password)
    raw.connect(address.host, address.port)
    raw.loop_start()
    try:
        with caplog.at_level(logging.WARNING, logger="fedfleet.wire"):
            for bad in (b"{not json", b'{"v": 99, "type": "status"}', b"FFCK\x07" + bytes(20)):
                raw.publish(topics.down, bad, qos=1).wait_for_publish(5)
            payload = os.urandom(300_000)
            coord.send(topics.down, payload).wait(60)
        assert inbox.arrived.wait(60) and inbox.payloads[0][1].data == payload
        assert dev.stats.rejected == 3
        text = caplog.text
        assert "not JSON" in text and "unsupported protocol version 99" in text and "chunk frame version 7" in text
    finally:
        raw.disconnect()
        raw.loop_stop()
        coord.stop()
        dev.stop()


def test_control_messages_reach_the_handler_and_the_device_status_is_retained(fresh_mosquitto):
    # A broker of its own: a status another test left retained on dev-b's topic would arrive too.
    from device_agent.wire.messages import Status

    seen = Inbox()
    broker = fresh_mosquitto
    coord = coordinator_session(broker.fleet, broker.address(), on_message=seen.on_message)
    dev, topics = device_session(broker.fleet, "dev-b", broker.address("dev-b"))
    dev.start()
    coord.start()
    try:
        dev.publish(topics.status, Status(device="dev-b", state="idle"), retain=True)
        deadline = time.monotonic() + 60
        while not seen.messages and time.monotonic() < deadline:
            time.sleep(0.02)
        [(topic, message)] = seen.messages
        assert topic == topics.status and message.state == "idle"
    finally:
        coord.stop()
        dev.stop()


def test_a_clean_stop_right_after_a_publish_never_has_the_broker_publish_the_will(fresh_mosquitto):
    """A DISCONNECT sent under an unacknowledged PUBLISH had mosquitto publish the will in about one stop in four:
    the agent's last words (a retained "stopped" status) were then overwritten by "connection lost"."""
    from device_agent.wire.messages import Status

    seen = Inbox()
    coord = coordinator_session(fresh_mosquitto.fleet, fresh_mosquitto.address(), on_message=seen.on_message).start()
    try:
        for _ in range(20):
            dev, topics = device_session(fresh_mosquitto.fleet, "dev-a", fresh_mosquitto.address("dev-a"))
            dev.start()
            dev.publish(topics.status, Status(device="dev-a", state="offline", detail="stopped"), retain=True)
            dev.stop()
        deadline = time.monotonic() + 60  # twenty statuses: a loaded host's broker may take more than a second
        while [m.detail for _t, m in seen.messages].count("stopped") < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a will comes from the broker after the connection closed
        details = [message.detail for _topic, message in seen.messages]
        assert details.count("stopped") == 20
        assert "connection lost" not in details
    finally:
        coord.stop()


@pytest.mark.slow
def test_the_same_delivery_works_on_the_amqtt_fallback(amqtt):
    coord, dev, inbox, topics = pair(amqtt, protocol="3.1.1")
    try:
        payload = os.urandom(5 * 2**20 + 17)
        coord.send(topics.down, payload).wait(120)
        assert inbox.arrived.wait(60) and inbox.payloads[0][1].data == payload
    finally:
        coord.stop()
        dev.stop()


def test_packets_queued_on_the_network_thread_go_out_without_waking_it_through_paho_s_socket_pair(mosquitto):
    inbox = Inbox()
    dev, topics = device_session(
        mosquitto.fleet, "dev-a", mosquitto.address("dev-a"), on_payload=inbox.on_payload, chunk_size=64 * 1024
    )
    coord = coordinator_session(mosquitto.fleet, mosquitto.address(), chunk_size=64 * 1024)
    dev.start()
    coord.start()
    pair, wakes = dev.connection.client._sockpairW, []

    class Recorder:  # paho writes a byte here to wake its network thread out of select()
        def send(self, data: bytes) -> int:
            wakes.append(threading.current_thread().name)
            return pair.send(data)

        def __getattr__(self, name: str) -> object:
            return getattr(pair, name)

    dev.connection.client._sockpairW = Recorder()
    try:
        payload = os.urandom(8 * 64 * 1024)
        coord.send(topics.down, payload).wait(60)  # each chunk PUBACKed by the device's network thread
        assert inbox.arrived.wait(60)
        assert inbox.payloads[0][1].data == payload
    finally:
        coord.stop()
        dev.stop()
    assert wakes  # the device's ack, published from another thread, still wakes it
    assert f"paho-mqtt-client-{dev.config.client_id}" not in wakes


def test_chunk_hooks_see_every_chunk_frame_both_ways_so_a_token_bucket_shapes_each_chunk(mosquitto):
    sent, received = [], []
    inbox = Inbox()
    chunk_size = 64 * 1024
    dev, topics = device_session(
        mosquitto.fleet,
        "dev-a",
        mosquitto.address("dev-a"),
        on_payload=inbox.on_payload,
        before_chunk_out=sent.append,
        after_chunk_in=received.append,
        chunk_size=chunk_size,
    )
    coord = coordinator_session(mosquitto.fleet, mosquitto.address(), chunk_size=chunk_size)
    dev.start()
    coord.start()
    try:
        payload = os.urandom(5 * chunk_size + 1000)
        coord.send(topics.down, payload).wait(60)
        assert inbox.arrived.wait(60)
        dev.send(topics.up, payload).wait(60)
    finally:
        coord.stop()
        dev.stop()
    for sizes in (received, sent):
        assert len(sizes) == 6  # one call per chunk: not one per payload, not for the manifest
        assert sum(sizes) > len(payload) and max(sizes) < chunk_size + 200  # frame = chunk + a small header
    assert sum(sent) == sum(received)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_a_refused_password_fails_start_at_once_and_names_the_user(mosquitto, protocol):
    address = mosquitto.address("dev-a")
    wrong = BrokerAddress(address.host, address.port, username="dev-a", password="not-the-password")
    session = Session(SessionConfig(client_id="refused-dev-a", broker=wrong, protocol=protocol), subscriptions=[])
    started = time.monotonic()
    with pytest.raises(LoginRefused, match="refused the login of user 'dev-a'"):
        session.start(timeout=60)
    assert time.monotonic() - started < 30, "a refused login must not wait out the (60 s) connect timeout"
    assert session.refused is not None and not session.connected


def test_broker_urls():
    address = BrokerAddress.from_url("mqtts://pi%40lab:s3cret@broker.example:9999", ca_file="/etc/ca.pem")
    assert (address.host, address.port, address.tls, address.username, address.password) == (
        "broker.example",
        9999,
        True,
        "pi@lab",
        "s3cret",
    )
    assert BrokerAddress.from_url("mqtt://localhost").port == 1883
    assert BrokerAddress.from_url("mqtts://h", username="u").username == "u"
    with pytest.raises(ValueError, match="scheme must be mqtt:// or mqtts://"):
        BrokerAddress.from_url("http://h")
    with pytest.raises(ValueError, match="not mqtts://"):
        BrokerAddress.from_url("mqtt://h", ca_file="ca.pem")


def test_one_manifest_hashed_beforehand_serves_several_devices(mosquitto):
    coord, dev_a, inbox_a, topics_a = pair(mosquitto, device="dev-a")
    inbox_b = Inbox()
    dev_b, topics_b = device_session(
        mosquitto.fleet, "dev-b", mosquitto.address("dev-b"), on_payload=inbox_b.on_payload
    )
    dev_b.start()
    try:
        payload = os.urandom(3 * 2**20 + 5)
        manifest = make_manifest(payload, kind="model")
        deliveries = [coord.send(t.down, payload, manifest=manifest) for t in (topics_a, topics_b)]
        for delivery in deliveries:
            delivery.wait(60)
        assert deliveries[0].transfer != deliveries[1].transfer != manifest.transfer
        for inbox in (inbox_a, inbox_b):
            assert inbox.arrived.wait(60)
            [(_, completed)] = inbox.payloads
            assert completed.data == payload and completed.manifest.digest == manifest.digest
    finally:
        coord.stop()
        dev_a.stop()
        dev_b.stop()


def test_a_push_to_many_devices_holds_at_most_the_send_window_in_flight(mosquitto):
    """A coordinator sending a model to every device builds frames only as the broker confirms earlier ones."""
    window, chunk = 256 * 1024, 64 * 1024
    coord, dev_a, inbox_a, topics_a = pair(mosquitto, device="dev-a", send_window_bytes=window, chunk_size=chunk)
    inbox_b = Inbox()
    dev_b, topics_b = device_session(
        mosquitto.fleet, "dev-b", mosquitto.address("dev-b"), on_payload=inbox_b.on_payload, chunk_size=chunk
    )
    dev_b.start()
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], coord.in_window)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        payload = os.urandom(2 * 2**20 + 7)
        manifest = make_manifest(payload, chunk_size=chunk, kind="model")
        deliveries = [coord.send(t.down, payload, manifest=manifest) for t in (topics_a, topics_b)]
        for delivery in deliveries:
            delivery.wait(60)
        for inbox in (inbox_a, inbox_b):
            assert inbox.arrived.wait(60)
            assert [c.data == payload for _, c in inbox.payloads] == [True]
    finally:
        done.set()
        watcher.join()
        coord.stop()
        dev_a.stop()
        dev_b.stop()
    assert 0 < peak[0] < window + chunk + 200  # the window plus the one frame that crossed it
    assert coord.in_window == 0  # every frame confirmed, none counted twice


def test_session_sockets_send_small_packets_without_waiting_for_nagle(mosquitto):
    coord, dev, _inbox, _topics = pair(mosquitto)
    try:
        for session in (coord, dev):
            assert session.connection.client.socket().getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        coord.stop()
        dev.stop()


def test_uploads_are_verified_once_per_chunk_on_the_hashing_pool_and_the_seal_waits_for_them(mosquitto, monkeypatch):
    # paho's thread reads on while the pool hashes; a seal that overtook its chunks would nack them for nothing.
    from device_agent.wire import receiving as receiving_module

    hashed_on: list[str] = []

    def slow_check(data, digest):
        hashed_on.append(threading.current_thread().name)
        time.sleep(0.02)  # hashing slower than the link: the seal arrives while chunks wait for the pool
        return hashlib.sha256(data).digest() == digest

    monkeypatch.setattr(receiving_module, "chunk_is_intact", slow_check)
    inbox = Inbox()
    coord = coordinator_session(mosquitto.fleet, mosquitto.address(), on_payload=inbox.on_payload).start()
    dev, topics = device_session(mosquitto.fleet, "dev-a", mosquitto.address("dev-a"))
    dev.start()
    try:
        payload = os.urandom(3 * 2**20 + 5)
        dev.send(topics.up, payload, run="r", kind="update").wait(60)  # unsealed: the seal follows the chunks
        assert inbox.arrived.wait(60)
        [(_, completed)] = inbox.payloads
        assert completed.data == payload
        assert len(hashed_on) == completed.manifest.chunk_count
        assert all(name.startswith("fedfleet-sha256") for name in hashed_on)
        assert dev.stats.published == completed.manifest.chunk_count + 2  # manifest, chunks, seal: none twice
    finally:
        coord.stop()
        dev.stop()


def test_a_manifest_waits_for_its_chunks_only_so_long_then_goes_on(mosquitto, monkeypatch, caplog):
    # A hashing pool that stopped keeping up must not stop the network thread's reading for good.
    from device_agent.wire import receiving as receiving_module

    release = threading.Event()

    def stuck_check(data, digest):
        release.wait(90)  # released by the test once the warning shows (at most 60 s)
        return hashlib.sha256(data).digest() == digest

    monkeypatch.setattr(receiving_module, "chunk_is_intact", stuck_check)
    monkeypatch.setattr(receiving_module, "AWAIT_CHUNKS_S", 0.3)
    inbox = Inbox()
    coord = coordinator_session(mosquitto.fleet, mosquitto.address(), on_payload=inbox.on_payload).start()
    dev, topics = device_session(mosquitto.fleet, "dev-a", mosquitto.address("dev-a"), chunk_size=64 * 1024)
    dev.start()
    try:
        with caplog.at_level(logging.WARNING, logger="fedfleet.wire"):
            delivery = dev.send(topics.up, os.urandom(3 * 64 * 1024), run="r", kind="update")  # unsealed
            assert until(lambda: "its manifest goes on" in caplog.text)
        release.set()
        delivery.wait(60)
        assert inbox.arrived.wait(60)
    finally:
        release.set()
        coord.stop()
        dev.stop()


def test_a_receiver_refuses_transfers_of_closed_rounds_at_their_manifest(mosquitto):
    received = Inbox()
    dev, topics = device_session(mosquitto.fleet, "dev-a", mosquitto.address("dev-a"))
    coord = coordinator_session(mosquitto.fleet, mosquitto.address(), on_payload=received.on_payload)
    dev.start()
    coord.start()
    try:
        assert coord.refuse(lambda manifest: manifest.round <= 1, "round 1 is closed") == 0
        late = dev.send(topics.up, os.urandom(3 * DEFAULT_CHUNK_SIZE), round=1)
        with pytest.raises(TransferError, match="round 1 is closed"):
            late.wait(60)
        assert late.refused
        dev.send(topics.up, os.urandom(1000), round=2).wait(60)
    finally:
        coord.stop()
        dev.stop()
    [(_topic, completed)] = received.payloads
    assert completed.manifest.round == 2


def test_a_cancelled_transfer_stops_sending_and_fails_without_counting_as_refused(mosquitto):
    release = threading.Event()
    dev, topics = device_session(
        mosquitto.fleet,
        "dev-a",
        mosquitto.address("dev-a"),
        before_chunk_out=lambda _size: release.wait(10),  # a link that holds every chunk until released
        chunk_size=64 * 1024,
    )
    dev.start()
    try:
        deliveries: list = []
        sending = threading.Thread(target=lambda: deliveries.append(dev.send(topics.up, os.urandom(8 * 64 * 1024))))
        sending.start()
        # Cancelled once the transfer exists (its first chunk held by the link); 0 until the thread has sent it.
        # (tests.waiting.until asks once more only while it fails: a second cancel would find nothing left.)
        assert until(lambda: dev.cancel(lambda manifest: manifest.round == 0, "superseded") == 1)
        release.set()
        sending.join(10)
        [delivery] = deliveries
        with pytest.raises(TransferError, match="cancelled: superseded"):
            delivery.wait(1)
        assert not delivery.refused and dev.stats.bytes_out[topics.up] < 3 * 64 * 1024
    finally:
        dev.stop()


class SealLosingSession(Session):
    """Loses the first seal it sends: only the receiver's timer (a nack after silence) can finish that transfer."""

    lost = False

    def _publish(self, topic, data, retain=False, transfer=None, windowed=False):
        if not self.lost and not is_chunk_frame(data) and b'"chunks":["' in data:
            self.lost = True
            return None
        return super()._publish(topic, data, retain, transfer, windowed)


def test_an_idle_session_s_timer_sleeps_until_a_transfer_starts_and_repairs_it_at_once(fresh_mosquitto):
    # A broker of its own: what earlier tests left queued for these client ids would keep them busy.
    # resend_after_s 10: the transfer finishes within 5 s only if the idle receiver's timer wakes for it and nacks.
    coord, dev, inbox, topics = pair(
        fresh_mosquitto, session_class=SealLosingSession, tick_s=0.1, nack_after_s=0.3, resend_after_s=10
    )
    ticks = []
    tick = dev._tick
    dev._tick = lambda now: (ticks.append(now), tick(now))
    try:
        assert until(lambda: dev.timer.idle and coord.timer.idle), "the sessions never went idle"
        ticks.clear()
        time.sleep(1.0)
        assert ticks == []  # 10 ticks at tick_s if it kept ticking while idle
        payload = os.urandom(300_000)
        coord.send(topics.down, payload).wait(60)
        assert inbox.arrived.wait(60) and inbox.payloads[0][1].data == payload
        assert coord.lost and dev.receivers.peers[topics.up].stats.nacks >= 1 and ticks
        assert until(lambda: dev.timer.idle and coord.timer.idle), "the sessions stayed busy after the transfer"
    finally:
        coord.stop()
        dev.stop()


def test_an_idle_connection_s_network_thread_wakes_at_a_quarter_of_its_keepalive(fresh_mosquitto):
    coord, dev, inbox, topics = pair(fresh_mosquitto, keepalive_s=40)
    wakes = []
    loop_misc = dev.connection.client.loop_misc
    dev.connection.client.loop_misc = lambda: (wakes.append(time.monotonic()), loop_misc())[1]
    try:
        assert dev.connection.client.idle_s == 10.0 and coord.connection.client.idle_s == 10.0
        time.sleep(0.5)  # past the connect's packets
        wakes.clear()
        time.sleep(2.5)
        assert len(wakes) <= 1  # paho's loop_start wakes every second
        from device_agent.wire.messages import Status

        sent = time.monotonic()
        coord.publish(topics.down, Status(device="dev-a", state="idle"))
        assert until(lambda: inbox.messages)
        assert wakes and wakes[0] - sent < 1.0  # a publish from another thread still wakes it at once
    finally:
        coord.stop()
        dev.stop()


def test_a_timer_that_finds_a_shaped_link_pumping_waits_for_its_next_tick_instead_of_spinning(fresh_mosquitto):
    inbox = Inbox()
    dev, topics = device_session(
        fresh_mosquitto.fleet,
        "dev-a",
        fresh_mosquitto.address("dev-a"),
        before_chunk_out=lambda _size: time.sleep(0.1),  # a slow uplink: 8 chunks take 0.8 s
        chunk_size=64 * 1024,
    )
    coord = coordinator_session(fresh_mosquitto.fleet, fresh_mosquitto.address(), on_payload=inbox.on_payload)
    dev.start()
    coord.start()
    pumps = []
    pump = dev._pump
    dev._pump = lambda retry=True: (pumps.append(retry), pump(retry))[1]
    try:
        assert until(lambda: dev.timer.idle), "the device session never went idle"
        dev.send(topics.up, os.urandom(8 * 64 * 1024)).wait(60)
        assert inbox.arrived.wait(60)
        assert len(pumps) < 50  # the first send pumps; the timer tries once per tick (0.2 s), not thousands of times
    finally:
        coord.stop()
        dev.stop()


def test_a_session_whose_socket_lands_past_descriptor_1023_never_connects(mosquitto):
    # Why a worker holds at most MAX_DEVICES_PER_WORKER devices: paho's select() cannot watch such a socket, and
    # paho takes the ValueError for a lost connection, retrying forever without a word.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard if hard != resource.RLIM_INFINITY else soft) < 1100:
        pytest.skip(f"this process may open at most {soft} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    filler = []
    try:
        while (fd := os.open(os.devnull, os.O_RDONLY)) < 1030:
            filler.append(fd)
        filler.append(fd)
        dev, _ = device_session(mosquitto.fleet, "dev-a", mosquitto.address("dev-a"))
        with pytest.raises(ConnectionError, match="could not connect"):
            dev.start(timeout=3)
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_timer_polls_only_the_peers_with_a_transfer_on_its_way(fresh_mosquitto):
    # A coordinator hears from 1,000 devices; its timer ticks five times a second while any upload is open.
    inbox = Inbox()
    coord = coordinator_session(fresh_mosquitto.fleet, fresh_mosquitto.address(), on_payload=inbox.on_payload)
    done, topics_a = device_session(fresh_mosquitto.fleet, "dev-a", fresh_mosquitto.address("dev-a"))
    held = threading.Event()
    slow, topics_b = device_session(
        fresh_mosquitto.fleet,
        "dev-b",
        fresh_mosquitto.address("dev-b"),
        before_chunk_out=lambda _size: held.wait(10),  # dev-b's link stalls: its upload stays open
        chunk_size=64 * 1024,
    )
    for session in (coord, done, slow):
        session.start()
    try:
        done.send(topics_a.up, os.urandom(1000)).wait(10)
        sending = threading.Thread(target=lambda: slow.send(topics_b.up, os.urandom(4 * 64 * 1024)))
        sending.start()
        assert until(lambda: coord.receiving()), "dev-b's upload never opened"
        polls = {key: [] for key in coord.receivers.peers}
        for key, receiver in coord.receivers.peers.items():
            poll = receiver.poll
            receiver.poll = lambda now, poll=poll, key=key: (polls[key].append(now), poll(now))[1]
        assert until(lambda: len(polls[topics_b.down]) >= 3)  # the timer polls the open upload (5 a second)...
        assert polls[topics_a.down] == []  # ... and never the finished one meanwhile
        held.set()
        sending.join(10)
        assert until(lambda: len(inbox.payloads) == 2)
        assert until(lambda: coord.timer.idle and not coord.receiving())
    finally:
        held.set()
        for session in (coord, done, slow):
            session.stop()


def test_sessions_in_one_process_hash_on_one_shared_pool(fresh_mosquitto):
    # An emulation worker hosts hundreds of sessions: a pool each would cost it three idle threads per device.
    from device_agent.wire.hashing import THREADS

    inbox = Inbox()
    coord = coordinator_session(fresh_mosquitto.fleet, fresh_mosquitto.address(), on_payload=inbox.on_payload)
    devices = [
        device_session(fresh_mosquitto.fleet, name, fresh_mosquitto.address(name), chunk_size=64 * 1024)
        for name in DEVICES
    ]
    coord.start()
    for session, _topics in devices:
        session.start()
    try:
        payload = os.urandom(4 * 64 * 1024)
        for session, topics in devices:  # unsealed: the sender hashes its chunks as it sends them
            session.send(topics.up, payload)
        assert until(lambda: len(inbox.payloads) == len(devices))
        assert all(completed.data == payload for _topic, completed in inbox.payloads)
        hashing = [t for t in threading.enumerate() if t.name.startswith("fedfleet-sha256")]
        assert 0 < len(hashing) <= THREADS
        assert not [t for t in threading.enumerate() if "hash-" in t.name or "verify-" in t.name]
    finally:
        coord.stop()
        for session, _topics in devices:
            session.stop()


def _frames_held_by(thread_name: str, smallest: int) -> list[int]:
    """Sizes of the byte buffers (``smallest`` or longer) that the named thread's frames hold in their locals."""
    thread = next(t for t in threading.enumerate() if t.name == thread_name)
    frame, held = sys._current_frames()[thread.ident], []
    while frame is not None:
        values = list(frame.f_locals.values())
        while values:
            value = values.pop()
            if isinstance(value, tuple):
                values.extend(value)
            elif isinstance(value, (bytes, bytearray, memoryview)) and len(value) >= smallest:
                held.append(len(value))
        frame = frame.f_back
    return held


def test_a_receiving_session_holds_no_chunk_frame_once_its_payload_is_delivered(mosquitto):
    """A worker's 250 devices each kept the last chunk frame of their download on the thread that took it until
    the next round (tracemalloc: 33 MiB a worker at 1,000 devices)."""
    coord, dev, inbox, topics = pair(mosquitto)
    try:
        payload = os.urandom(DEFAULT_CHUNK_SIZE + 100_000)
        coord.send(topics.down, payload, kind="model").wait(60)
        assert inbox.arrived.wait(60)
        [(_, completed)] = inbox.payloads
        assert completed.data == payload
        inbox.payloads.clear()
        del completed
        # Once paho's thread is back waiting for the next packet (late on a loaded host), it holds no frame.
        assert until(lambda: _frames_held_by(f"paho-mqtt-client-{dev.config.client_id}", 50_000) == [])
    finally:
        coord.stop()
        dev.stop()
