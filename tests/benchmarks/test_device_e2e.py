"""The pieces of benchmarks.device_e2e that need no root, qemu or rootfs (the run itself: tests/e2e)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from benchmarks.device_e2e import HOST_IP, MIDR, PI, exec_start, fake_sys, fleet_yaml, passwd_ids, unit_user
from coordinator.config.fleet import load_fleet
from coordinator.provision import DeviceLayout, provision


def test_the_fleet_dials_the_broker_at_a_veth_address_in_its_certificate_not_loopback(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(fleet_yaml(18999, rounds=2))
    fleet, _ = load_fleet(tmp_path / "fleet.yaml")
    assert fleet.broker.hosts == [HOST_IP] and not ipaddress.ip_address(HOST_IP).is_loopback
    kits = provision(fleet, tmp_path / "kits", (), DeviceLayout()).kits
    agent_yaml = (kits.participant(PI) / "agent.yaml").read_text()
    assert f"url: mqtts://{HOST_IP}:18999" in agent_yaml
    unit = kits.participant(PI) / "fedfleet-agent.service"
    assert exec_start(unit) == [
        "/opt/fedfleet/venv/bin/device-agent",
        "run",
        "--config",
        "/opt/fedfleet/etc/agent.yaml",
    ]
    assert unit_user(unit) == "fedfleet"


def test_the_fake_sys_names_an_arm_cpu_for_each_core(tmp_path: Path) -> None:
    fake_sys(tmp_path, 3)
    cpu = tmp_path / "devices" / "system" / "cpu"
    assert (cpu / "possible").read_text() == "0-2\n"
    midrs = sorted(cpu.glob("cpu*/regs/identification/midr_el1"))
    assert [p.parts[-4] for p in midrs] == ["cpu0", "cpu1", "cpu2"] and midrs[0].read_text() == MIDR + "\n"


def test_the_service_user_is_looked_up_in_the_roots_passwd(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\nfedfleet:x:999:996::/var/lib/fedfleet:/x\n")
    assert passwd_ids(tmp_path, "fedfleet") == "999:996"
