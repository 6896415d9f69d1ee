"""Builder 2: the fleet's own CA, the broker's server certificate and one client certificate per participant.

Keys are EC P-256 (small and fast on a Pi). The CA key stays in ``kits/ca/`` and is never copied
into a kit. Existing certificates are kept; the server certificate is reissued when the broker's
host names change, a participant's when it is rotated. A rotated certificate's serial goes on the
CA's revocation list (``crl.pem``), which the broker checks, so an old kit is refused twice over:
by its password and by its certificate.

A client certificate's CN is its participant's broker login: the broker takes the CN as the user name
(mosquitto ``use_identity_as_username``), so each certificate is bound to exactly one login. A
certificate whose CN is not its participant's login, or that is already revoked, is reissued; the
certificate of a device no longer in the fleet is revoked (its password leaves the password file,
but on the TLS listener the certificate alone is the credential). Each device also gets a doctor
certificate (``doctor.pem``, CN ``doctor@<device>``): the read-only login ``device-agent doctor`` asks with.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from coordinator.provision.layout import CA_CERT, CLIENT_CERT, CLIENT_KEY, DOCTOR_CERT, DOCTOR_KEY, Kits, private_dir
from coordinator.transport.broker.credentials import write_file

CA_KEY = "ca.key"
CRL = "crl.pem"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
_REVOKED = "revoked.json"
_CA_YEARS = 10
_LEAF_YEARS = 5


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedfleet"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


class Authority:
    """The fleet's CA: loaded from ``kits/ca`` or created there once."""

    def __init__(self, kits: Kits, fleet: str) -> None:
        self.folder = private_dir(kits.ca)
        cert_path, key_path = self.folder / CA_CERT, self.folder / CA_KEY
        if not cert_path.exists():
            key = ec.generate_private_key(ec.SECP256R1())
            name = _name(f"fedfleet {fleet} CA")
            cert = (
                x509.CertificateBuilder()
                .subject_name(name)
                .issuer_name(name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(_now() - dt.timedelta(hours=1))
                .not_valid_after(_now() + dt.timedelta(days=365 * _CA_YEARS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
                )
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256())
            )
            write_file(key_path, _key_pem(key), 0o600)
            write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        self.cert = _load_cert(cert_path)
        loaded = serialization.load_pem_private_key(key_path.read_bytes(), None)
        assert isinstance(loaded, ec.EllipticCurvePrivateKey)
        self.key = loaded
        self.pem = cert_path.read_bytes()

    def issue(self, common_name: str, server_names: Iterable[str] = ()) -> tuple[bytes, bytes]:
        """A leaf (certificate PEM, key PEM): for a server when ``server_names`` are given, else for a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        names = list(server_names)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if names else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(hours=1))
            .not_valid_after(_now() + dt.timedelta(days=365 * _LEAF_YEARS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        if names:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False
            )
        cert = builder.sign(self.key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    def revoke(self, cert_path: Path) -> None:
        """Put the certificate at ``cert_path`` on the revocation list (before it is replaced)."""
        if cert_path.exists():
            serials = self._revoked()
            serials.append(_load_cert(cert_path).serial_number)
            write_file(self.folder / _REVOKED, json.dumps(sorted(set(serials))) + "\n", 0o644)

    def is_revoked(self, cert_path: Path) -> bool:
        return _load_cert(cert_path).serial_number in self._revoked()

    def _revoked(self) -> list[int]:
        path = self.folder / _REVOKED
        return json.loads(path.read_text()) if path.exists() else []

    def crl(self) -> bytes:
        """The current revocation list, signed, valid for the CA's lifetime (re-provisioning renews it)."""
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.cert.subject)
            .last_update(_now() - dt.timedelta(hours=1))
            .next_update(self.cert.not_valid_after_utc)
        )
        for serial in self._revoked():
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(_now()).build()
            )
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def common_name(cert_path: Path) -> str:
    """The CN of the certificate at ``cert_path``: the user name the broker logs it in as."""
    names = _load_cert(cert_path).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def server_names(cert_path: Path) -> list[str]:
    """The host names and IPs a server certificate covers."""
    san = _load_cert(cert_path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n) for n in san.get_values_for_type(x509.DNSName)] + [
        str(ip) for ip in san.get_values_for_type(x509.IPAddress)
    ]


def build_certificates(
    authority: Authority, kits: Kits, hosts: list[str], logins: Mapping[str, str], rotate: Collection[str] = ()
) -> None:
    """Server certificate for ``hosts`` into ``kits/broker``, a client certificate into each participant's folder.

    ``logins`` maps each participant (its kit folder) to its broker user name, the CN of its certificate.
    A replaced certificate is revoked, and so is the one in a kit folder that is no participant any
    more (a device removed from fleet.yaml), unless it names another participant's login (a copy).
    """
    broker = private_dir(kits.broker, 0o711)
    server_cert = broker / SERVER_CERT
    if not server_cert.exists() or sorted(server_names(server_cert)) != sorted(
        str(_general_name(h).value) for h in hosts
    ):
        cert, key = authority.issue("fedfleet broker", hosts)
        write_file(broker / SERVER_KEY, key, 0o600)
        write_file(server_cert, cert, 0o644)
    live = set(logins.values())
    for departed in sorted(kits.root.iterdir()):
        cert_path = departed / CLIENT_CERT
        if departed.name not in logins and cert_path.is_file() and common_name(cert_path) not in live:
            authority.revoke(cert_path)
    for name, login in logins.items():
        folder = private_dir(kits.participant(name))
        if _current(authority, folder / CLIENT_CERT, login) and name not in rotate:
            continue
        if (folder / CLIENT_CERT).exists() and common_name(folder / CLIENT_CERT) not in live - {login}:
            authority.revoke(folder / CLIENT_CERT)  # never another participant's live certificate copied here
        cert, key = authority.issue(login)
        write_file(folder / CLIENT_KEY, key, 0o600)
        write_file(folder / CLIENT_CERT, cert, 0o644)
    for folder in (broker, *(kits.participant(n) for n in logins)):
        write_file(folder / CA_CERT, authority.pem, 0o644)


def _current(authority: Authority, cert_path: Path, login: str) -> bool:
    """A certificate to keep: there, issued for ``login`` and not revoked."""
    if not cert_path.exists():
        return False
    return common_name(cert_path) == login and not authority.is_revoked(cert_path)


def build_doctor_certificates(
    authority: Authority, kits: Kits, logins: Mapping[str, str], rotate: Collection[str] = ()
) -> None:
    """Each device's doctor certificate (CN = its doctor login) into its kit folder, as :func:`build_certificates`
    does its own: kept while current, revoked when replaced or when the device left the fleet."""
    for departed in sorted(kits.root.iterdir()):
        if departed.name not in logins and (departed / DOCTOR_CERT).is_file():
            authority.revoke(departed / DOCTOR_CERT)
    for device, login in logins.items():
        folder = private_dir(kits.participant(device))
        if _current(authority, folder / DOCTOR_CERT, login) and device not in rotate:
            continue
        authority.revoke(folder / DOCTOR_CERT)
        cert, key = authority.issue(login)
        write_file(folder / DOCTOR_KEY, key, 0o600)
        write_file(folder / DOCTOR_CERT, cert, 0o644)
