"""Handshake failures named: this clock against the broker certificate's window, a CA of another fleet."""

from __future__ import annotations

import datetime as dt
import logging
import time
from pathlib import Path

import pytest
from cryptography import x509

from device_agent.wire.session import BrokerAddress, Session, SessionConfig
from device_agent.wire.tls_errors import classify, validity, why_tls_fails
from tests.device_agent.wire.tls_servers import make_pki, tls_server

NOW = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def test_validity_reads_the_window_of_a_der_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path, NOW + dt.timedelta(days=400), NOW + dt.timedelta(days=800))
    cert = x509.load_pem_x509_certificate(pki.cert_file.read_bytes())
    from cryptography.hazmat.primitives.serialization import Encoding

    assert validity(cert.public_bytes(Encoding.DER)) == (cert.not_valid_before_utc, cert.not_valid_after_utc)


def test_a_certificate_from_the_future_names_the_clock_and_the_window(tmp_path: Path) -> None:
    """What a Pi that booted in the past sees: the broker's certificate is not valid yet by this clock."""
    start, end = NOW + dt.timedelta(days=2), NOW + dt.timedelta(days=30)
    pki = make_pki(tmp_path, start, end)
    with tls_server(pki) as port:
        problem = why_tls_fails("localhost", port, str(pki.ca_file), timeout=5)
    assert problem is not None and problem.kind == "clock"
    assert "not yet valid" in problem.reason
    assert f"valid from {start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M}" in problem.hint
    assert "this device's clock says" in problem.hint and "NTP" in problem.hint


def test_an_expired_certificate_is_named_as_expired(tmp_path: Path) -> None:
    pki = make_pki(tmp_path, NOW - dt.timedelta(days=30), NOW - dt.timedelta(days=1))
    with tls_server(pki) as port:
        problem = why_tls_fails("localhost", port, str(pki.ca_file), timeout=5)
    assert problem is not None and problem.kind == "clock" and "expired" in problem.reason
    assert "re-provision the broker" in problem.hint


def test_a_ca_that_did_not_sign_the_broker_is_named(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "broker", NOW - dt.timedelta(days=1), NOW + dt.timedelta(days=30))
    other = make_pki(tmp_path / "other", NOW - dt.timedelta(days=1), NOW + dt.timedelta(days=30))
    with tls_server(pki) as port:
        problem = why_tls_fails("localhost", port, str(other.ca_file), timeout=5)
    assert problem is not None and problem.kind == "ca"
    assert str(other.ca_file) in problem.hint and "broker.ca_file is not the CA" in problem.hint


def test_a_good_handshake_and_a_closed_port_are_not_tls_problems(tmp_path: Path) -> None:
    pki = make_pki(tmp_path, NOW - dt.timedelta(days=1), NOW + dt.timedelta(days=30))
    with tls_server(pki) as port:
        assert why_tls_fails("localhost", port, str(pki.ca_file), timeout=5) is None
    assert why_tls_fails("localhost", port, str(pki.ca_file), timeout=1) is None  # reachability's job


def test_classify_names_a_hostname_mismatch() -> None:
    problem = classify("Hostname mismatch, certificate is not valid for 'pi.local'.", "ca.pem", "pi.local")
    assert problem.kind == "hostname" and "broker.hosts" in problem.hint


def test_the_session_logs_the_clock_not_just_a_failed_connection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's session: a TLS failure is logged with its cause, once, instead of "the connection failed"."""
    start = NOW + dt.timedelta(days=2)
    pki = make_pki(tmp_path, start, NOW + dt.timedelta(days=30))
    with tls_server(pki) as port, caplog.at_level(logging.WARNING, logger="fedfleet.wire"):
        broker = BrokerAddress("localhost", port, "dev-a", "pw", tls=True, ca_file=str(pki.ca_file))
        session = Session(SessionConfig(client_id="dev-a", broker=broker, reconnect_max_s=1), subscriptions=[])
        session.start(timeout=None)
        try:
            deadline = time.monotonic() + 60
            while "cannot reach broker" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            session.stop()
    lines = [r.getMessage() for r in caplog.records if "cannot reach broker" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "not yet valid" in lines[0] and f"valid from {start:%Y-%m-%d %H:%M}" in lines[0]
    assert "the connection failed" not in lines[0]
