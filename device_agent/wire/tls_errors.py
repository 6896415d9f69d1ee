"""Why a TLS connection to the broker fails, in words a person at the device can act on.

paho reports a failed TLS handshake to nobody (its ``on_connect_fail`` gets no exception), so an
agent on a Pi that booted in 1970 only said "the connection failed; retrying". A handshake of our
own names the cause: this device's clock against the broker certificate's validity window (a board
without a battery-backed clock), a CA file that did not sign the broker's certificate (a kit of
another fleet), a certificate that does not name the host. Used by the session's connect-failure
log and by ``device-agent doctor``.
"""

from __future__ import annotations

import datetime as dt
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], dt.datetime]


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


@dataclass(frozen=True)
class TlsProblem:
    """One classified handshake failure: ``kind`` is clock, ca, hostname or other."""

    kind: str
    reason: str
    hint: str

    def __str__(self) -> str:
        return f"TLS: {self.reason}: {self.hint}"


def _der_items(data: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    """(tag, content start, content end) of each DER element in ``data[start:end]``."""
    items = []
    while start < end:
        tag, length = data[start], data[start + 1]
        start += 2
        if length & 0x80:
            count = length & 0x7F
            length = int.from_bytes(data[start : start + count], "big")
            start += count
        items.append((tag, start, start + length))
        start += length
    return items


def _der_time(tag: int, text: str) -> dt.datetime:
    if tag == 0x17:  # UTCTime: YYMMDDHHMMSSZ, years 1950-2049
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    return dt.datetime.strptime(text.rstrip("Z"), "%Y%m%d%H%M%S").replace(tzinfo=dt.timezone.utc)


def validity(der: bytes) -> tuple[dt.datetime, dt.datetime]:
    """(notBefore, notAfter) of a DER certificate: the standard library verifies but does not parse them."""
    (_, cert_start, cert_end), *_ = _der_items(der, 0, len(der))
    (_, tbs_start, tbs_end), *_ = _der_items(der, cert_start, cert_end)
    fields = _der_items(der, tbs_start, tbs_end)
    if fields[0][0] == 0xA0:  # explicit [0] version
        fields = fields[1:]
    _, valid_start, valid_end = fields[3]  # serial, signature algorithm, issuer, validity
    (tag0, s0, e0), (tag1, s1, e1) = _der_items(der, valid_start, valid_end)
    return _der_time(tag0, der[s0:e0].decode()), _der_time(tag1, der[s1:e1].decode())


def classify(
    error: BaseException | str,
    ca_file: str | None,
    host: str,
    window: tuple[dt.datetime, dt.datetime] | None = None,
    now: Clock = _utcnow,
) -> TlsProblem:
    """A handshake error (or its verify message) -> what is wrong and what to do about it."""
    reason = (getattr(error, "verify_message", None) or str(error)) if isinstance(error, BaseException) else error
    text = reason.lower()
    if "not yet valid" in text or "expired" in text:
        clock = f"this device's clock says {now():%Y-%m-%d %H:%M} UTC"
        if window is not None:
            start, end = window
            clock += f", the broker's certificate is valid from {start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M}"
        hint = "set the clock (NTP: timedatectl set-ntp true; a Pi without a battery boots in the past)"
        if "expired" in text and window is not None and now() >= window[1]:
            hint = "the broker's certificate has expired: re-provision the broker (coordinator provision)"
        return TlsProblem("clock", reason, f"{clock}: {hint}")
    # A re-created CA of the same name makes a "signature failure", not an unknown issuer.
    if any(s in text for s in ("local issuer", "self-signed", "self signed", "unknown ca", "signature failure")):
        return TlsProblem(
            "ca",
            reason,
            f"transport.broker.ca_file is not the CA of this fleet's broker ({ca_file or 'the system CAs'} did not "
            "sign its certificate): a kit of another fleet, or a re-created CA? install this fleet's current kit",
        )
    if "mismatch" in text or "hostname" in text:
        return TlsProblem(
            "hostname",
            reason,
            f"the broker's certificate does not name {host}: add it to the fleet's broker.hosts and re-provision",
        )
    return TlsProblem("other", reason, "check transport.broker.ca_file, cert_file and key_file")


def _peer_window(
    host: str, port: int, cert_file: str | None, key_file: str | None, timeout: float
) -> tuple[dt.datetime, dt.datetime] | None:
    """The broker certificate's validity, read without verifying it (it just failed verification)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        if cert_file:  # a broker that requires a client certificate ends the handshake without one
            context.load_cert_chain(cert_file, key_file)
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            der = tls.getpeercert(binary_form=True)
        return validity(der) if der else None
    except (OSError, ValueError, IndexError):
        return None


def why_tls_fails(
    host: str,
    port: int,
    ca_file: str | None,
    cert_file: str | None = None,
    key_file: str | None = None,
    timeout: float = 5.0,
    now: Clock = _utcnow,
) -> TlsProblem | None:
    """None when a verified TLS handshake with ``host:port`` succeeds (or TCP itself fails), else the problem."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
        if cert_file:
            context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        return TlsProblem("files", str(exc), "transport.broker.ca_file, cert_file or key_file cannot be read or used")
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return None
    except ssl.SSLCertVerificationError as exc:
        dated = "valid" in str(exc) or "expired" in str(exc)
        window = _peer_window(host, port, cert_file, key_file, timeout) if dated else None
        return classify(exc, ca_file, host, window, now)
    except ssl.SSLError as exc:
        return classify(exc, ca_file, host, None, now)
    except OSError:
        return None  # not a TLS problem: reachability says what it is
