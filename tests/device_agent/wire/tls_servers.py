"""A TLS server on a free port with a certificate of a chosen validity window, signed by a throwaway CA.

The clock of this machine cannot be set back for a test; a broker certificate dated in the future
(or the past) makes the same handshake failure a device with a wrong clock sees.
"""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _cert(name: str, key, issuer_name: str, issuer_key, start: dt.datetime, end: dt.datetime, ca: bool):
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    pkcs8, plain = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, pkcs8, plain)


@dataclass(frozen=True)
class Pki:
    ca_file: Path
    cert_file: Path
    key_file: Path
    start: dt.datetime
    end: dt.datetime


def make_pki(folder: Path, start: dt.datetime, end: dt.datetime) -> Pki:
    """A CA (valid now) and a ``localhost`` server certificate valid from ``start`` to ``end``."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("test-ca", ca_key, "test-ca", ca_key, now - dt.timedelta(days=1), now + dt.timedelta(days=30), True)
    cert = _cert("localhost", key, "test-ca", ca_key, start, end, False)
    folder.mkdir(parents=True, exist_ok=True)
    pki = Pki(folder / "ca.pem", folder / "server.pem", folder / "server.key", start, end)
    pki.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pki.key_file.write_bytes(_pem_key(key))
    return pki


@contextmanager
def tls_server(pki: Pki) -> Iterator[int]:
    """Accept TLS handshakes on 127.0.0.1 until the block ends; yields the port."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.cert_file, pki.key_file)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                raw, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            raw.settimeout(5)
            try:
                with context.wrap_socket(raw, server_side=True):
                    pass
            except OSError:
                raw.close()  # the client refused the certificate: the case under test

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()
