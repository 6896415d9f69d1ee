"""``coordinator start`` on a run that cannot or need not go on: finished, or out of disk space."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from coordinator.cli.app import main
from coordinator.cli.start import fleet_kits
from coordinator.config.fleet import load_fleet
from coordinator.provision import ProvisionError
from coordinator.run.metrics import RoundMetrics
from coordinator.run.rundir import RunDir
from coordinator.run.storage import out_of_space_message
from tests.paths import REPO_ROOT

DEMO = REPO_ROOT / "examples" / "demo.yaml"


def test_resuming_a_finished_run_says_so_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet_file = tmp_path / "demo.yaml"
    fleet_file.write_text(DEMO.read_text().replace("rounds: 10", "rounds: 1"))
    metrics = RoundMetrics(round=1, accuracy=0.9, loss=0.3, participants=0, bytes_up=0, bytes_down=0, seconds=1.0)
    with RunDir.create(tmp_path / "run", fleet_file, {"w": torch.zeros(2)}, seed=0) as rundir:
        rundir.complete_round(1, {"w": torch.ones(2)}, metrics)

    assert main(["start", "--fleet", str(fleet_file), "--run-dir", str(tmp_path / "run"), "--wait-timeout", "1"]) == 0
    assert f"{tmp_path / 'run'} is complete: all 1 rounds are done" in capsys.readouterr().out


def test_a_full_disk_is_a_clear_stop_message_and_other_os_errors_pass_through(tmp_path: Path) -> None:
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "state" / "x"))

    message = out_of_space_message(full, tmp_path / "run")

    assert message.startswith(f"no space left to write the run directory ({full.filename}): No space left on device")
    assert f"run the same command to resume {tmp_path / 'run'}" in message
    with pytest.raises(PermissionError):
        out_of_space_message(PermissionError(errno.EACCES, "Permission denied"), tmp_path)


@pytest.mark.slow
def test_uploads_accepted_before_the_disk_filled_survive_it(tmp_path: Path) -> None:
    """A real process with a file-size limit accepts uploads until a write fails, as on a full disk."""
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text("fleet: lab\n")
    RunDir.create(tmp_path / "run", fleet_file, {"w": torch.zeros(4)}, seed=0).close()
    child = textwrap.dedent(
        f"""
        import json, resource, torch
        from coordinator.run.rundir import RunDir
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))
        accepted = []
        with RunDir.open({str(tmp_path / "run")!r}) as rundir:
            try:
                for i in range(100):
                    rundir.accept_upload(1, f"d{{i}}", f"t{{i}}", {{"u": torch.full((40 + 20 * i,), float(i))}})
                    accepted.append(f"d{{i}}")
            except OSError as exc:
                print(json.dumps({{"accepted": accepted, "errno": exc.errno}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)

    assert result["errno"] == errno.EFBIG and len(result["accepted"]) >= 2
    with RunDir.open(tmp_path / "run") as rundir:
        journal = rundir.resume().journal
        assert [entry.device for entry in journal] == result["accepted"]
        for number, entry in enumerate(journal):
            assert torch.equal(rundir.load_upload(entry)["u"], torch.full((40 + 20 * number,), float(number)))


def test_kits_without_tls_for_a_tls_fleet_are_refused_for_real_devices_and_upgraded_for_emulated_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the amqtt fallback leaves behind (plain kits) once mosquitto serves the fleet with TLS."""
    fleet, _ = load_fleet(DEMO)
    plain = fleet.with_broker(fleet.broker.model_copy(update={"mode": "amqtt", "tls": False}))
    kits_dir = tmp_path / "kits"
    fleet_kits(plain, kits_dir, emulated=True)
    passwords = {name: c.password for name, c in fleet_kits(plain, kits_dir)[1].items()}
    with pytest.raises(
        ProvisionError, match=r"were provisioned without TLS, .* \(coordinator provision --fleet FLEET --out "
    ):
        fleet_kits(fleet, kits_dir)
    _, credentials = fleet_kits(fleet, kits_dir, emulated=True)
    assert f"the kits in {kits_dir} were provisioned without TLS" in capsys.readouterr().out
    assert json.loads((kits_dir / "fleet.json").read_text())["tls"] is True
    assert {name: c.password for name, c in credentials.items()} == passwords  # the same logins, now over TLS
    assert "url: mqtts://" in (kits_dir / "orin-01" / "agent.yaml").read_text()


def test_emulated_kits_are_folders_without_device_bundles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Emulated devices read their kit folders on this host: no ``<device>.tar.gz`` is gzipped for them."""
    fleet, _ = load_fleet(DEMO)
    emulated, _ = fleet_kits(fleet, tmp_path / "emulated", emulated=True)
    assert (emulated.participant("orin-01") / "agent.yaml").is_file()
    assert not emulated.bundle("orin-01").exists()
    assert "no device bundles: coordinator provision --fleet FLEET --out" in capsys.readouterr().out
    real, _ = fleet_kits(fleet, tmp_path / "real")
    assert real.bundle("orin-01").is_file()
