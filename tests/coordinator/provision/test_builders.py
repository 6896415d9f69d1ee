"""Provisioning as a list of builders: a site adds its own step to the list; a misordered list is refused."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from coordinator.provision import BUILDERS, Builder, DeviceLayout, ProvisionError, Provisioning, provision
from tests.coordinator.provision.kit_fixtures import make_fleet


def test_a_builder_added_before_the_bundles_puts_its_file_in_every_bundle(tmp_path: Path) -> None:
    _, fleet = make_fleet()

    def site_notes(run: Provisioning) -> None:
        for device in run.fleet.devices:
            kit = run.kits.participant(device.id)
            assert (kit / "agent.yaml").exists()  # the builders before it have run
            (kit / "site.txt").write_text(f"rack 4, {device.id}\n")

    names = [b.name for b in BUILDERS]
    at = names.index("bundles")
    builders = [*BUILDERS[:at], Builder("site notes", site_notes), *BUILDERS[at:]]
    kits = provision(
        fleet, tmp_path / "kits", layout=DeviceLayout(tmp_path / "opt", tmp_path / "state"), builders=builders
    ).kits
    with tarfile.open(kits.bundle("b")) as tar:
        notes = tar.extractfile("b/site.txt")
        assert notes is not None and notes.read() == b"rack 4, b\n"


def test_a_builder_before_the_one_it_needs_is_refused_by_name(tmp_path: Path) -> None:
    _, fleet = make_fleet()
    without_ca = [b for b in BUILDERS if b.name != "certificates"]
    with pytest.raises(ProvisionError, match="builder 'broker files' needs the CA, made by builder 'certificates'"):
        provision(fleet, tmp_path / "kits", builders=without_ca)
