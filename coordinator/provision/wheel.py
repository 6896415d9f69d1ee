"""Builder 4a: the agent's own wheel, ``fedfleet_agent-<version>-py3-none-any.whl``.

Why a separate distribution: ``pip install fedfleet`` on a device would bring the ``coordinator``
command, which needs the coordinator extra. The agent wheel holds ``device_agent`` only, the
``device-agent`` command and the agent's dependencies; scikit-learn (the built-in ``digits`` demo
data) is its ``demo`` extra. It is written directly (a wheel is a zip with metadata), without a
build backend or network, with fixed timestamps so re-provisioning yields the same bytes.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import zipfile
from pathlib import Path

import device_agent
from device_agent.common.atomic import atomic_write

DIST = "fedfleet_agent"
DEMO_EXTRA = ["scikit-learn>=1.3"]
DEMO_DATASETS = ("digits",)
"""The data sets the demo extra is for: scikit-learn ships digits; fashion_mnist is read from Debian's package."""
_EPOCH = (2020, 1, 1, 0, 0, 0)


def agent_requirements() -> list[str]:
    """The fedfleet distribution's base dependencies (no extras): exactly what the agent needs."""
    try:
        requires = importlib.metadata.requires("fedfleet") or []
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("the fedfleet distribution is not installed; pip install -e '.[coordinator]'") from None
    return [r for r in requires if "extra ==" not in r]


def extra_requirements(extra: str) -> list[str]:
    """The fedfleet distribution's requirements of one extra (``secagg``: cryptography), without the marker."""
    marker = f'extra == "{extra}"'
    requires = importlib.metadata.requires("fedfleet") or []
    return [r.split(";")[0].strip() for r in requires if marker in r]


def wheel_name() -> str:
    return f"{DIST}-{device_agent.__version__}-py3-none-any.whl"


def build_agent_wheel(out_dir: Path) -> Path:
    """Write the agent wheel into ``out_dir``; returns its path."""
    version = device_agent.__version__
    info = f"{DIST}-{version}.dist-info"
    package = Path(device_agent.__file__).parent
    files: list[tuple[str, bytes]] = [
        (f"device_agent/{p.relative_to(package).as_posix()}", p.read_bytes())
        for p in sorted(package.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    ]
    metadata = [
        "Metadata-Version: 2.1",
        "Name: fedfleet-agent",
        f"Version: {version}",
        "Summary: fedfleet device agent: trains any fedfleet strategy's client program on an edge device",
        "License: Apache-2.0",
        "Requires-Python: >=3.10",
        *(f"Requires-Dist: {r}" for r in agent_requirements()),
        "Provides-Extra: demo",
        *(f'Requires-Dist: {r}; extra == "demo"' for r in DEMO_EXTRA),
        "Provides-Extra: secagg",
        *(f'Requires-Dist: {r}; extra == "secagg"' for r in extra_requirements("secagg")),
    ]
    files += [
        (f"{info}/METADATA", ("\n".join(metadata) + "\n").encode()),
        (
            f"{info}/WHEEL",
            b"Wheel-Version: 1.0\nGenerator: fedfleet-provision\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        ),
        (f"{info}/entry_points.txt", b"[console_scripts]\ndevice-agent = device_agent.cli.app:main\n"),
    ]
    record = [f"{name},sha256={_digest(data)},{len(data)}" for name, data in files] + [f"{info}/RECORD,,"]
    files.append((f"{info}/RECORD", ("\n".join(record) + "\n").encode()))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / wheel_name()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files:
            entry = zipfile.ZipInfo(name, _EPOCH)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(entry, data)
    atomic_write(path, buffer.getvalue())
    return path


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
