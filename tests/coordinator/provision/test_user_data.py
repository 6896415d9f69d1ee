"""Every kit's cloud-init ``user-data`` is valid cloud-config, as ``cloud-init schema`` itself judges it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from coordinator.provision import DeviceLayout, provision
from tests.coordinator.provision.kit_fixtures import KINDS, kinds_fleet


def schema(path: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("cloud-init") is None:
        pytest.skip("cloud-init is not installed (apt-get install cloud-init)")
    return subprocess.run(["cloud-init", "schema", "--config-file", str(path)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("user-data")
    return provision(kinds_fleet(root), root / "kits", (), DeviceLayout()).kits.root


@pytest.mark.parametrize("device", sorted(KINDS))
def test_each_kits_user_data_passes_cloud_inits_schema(kits: Path, device: str) -> None:
    user_data = kits / device / "user-data"
    done = schema(user_data)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Valid cloud-config" in done.stdout
    assert f"/boot/firmware/{device}.tar.gz" in user_data.read_text()


def test_the_schema_check_refuses_a_broken_user_data(tmp_path: Path) -> None:
    """The check above can fail: runcmd as a mapping is not cloud-config."""
    broken = tmp_path / "user-data"
    broken.write_text("#cloud-config\nruncmd: {install: sh install.sh}\n")
    done = schema(broken)
    assert done.returncode != 0 and "runcmd" in done.stdout + done.stderr
