"""Where a broker is and how to log in to it: what a session connects to, and what kits and the CLI pass around."""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker is and how to log in to it."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ca_file: str | None = None
    # A client certificate and its key (PEM), for brokers that require one (a provisioned fleet's do).
    cert_file: str | None = None
    key_file: str | None = None

    def with_login(self, username: str, password: str) -> BrokerAddress:
        """The same broker and TLS files, another user's login."""
        return replace(self, username=username, password=password)

    @classmethod
    def from_url(
        cls, url: str, username: str | None = None, password: str | None = None, ca_file: str | None = None
    ) -> BrokerAddress:
        """``mqtt://[user:pass@]host[:1883]`` or ``mqtts://[user:pass@]host[:8883]``; arguments override the URL."""
        parts = urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts"):
            raise ValueError(f"broker URL {url!r}: scheme must be mqtt:// or mqtts://, got {parts.scheme or 'none'!r}")
        if not parts.hostname:
            raise ValueError(f"broker URL {url!r} has no host")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"broker URL {url!r}: unexpected path or query {parts.path}{parts.query}")
        tls = parts.scheme == "mqtts"
        try:
            port = parts.port or (8883 if tls else 1883)
        except ValueError:
            raise ValueError(f"broker URL {url!r} has an invalid port") from None
        if ca_file and not tls:
            raise ValueError(f"a CA file was given for {url!r}, which is not mqtts://")
        return cls(
            host=parts.hostname,
            port=port,
            username=username if username is not None else (unquote(parts.username) if parts.username else None),
            password=password if password is not None else (unquote(parts.password) if parts.password else None),
            tls=tls,
            ca_file=ca_file,
        )

    @property
    def url(self) -> str:
        """The address without credentials, for logs."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"
