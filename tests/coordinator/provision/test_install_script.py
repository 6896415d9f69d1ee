"""A rendered kit's install.sh and uninstall.sh run under bash against a fake root, with stubs for the system.

The stubs (``python3``, the venv's ``python``, ``pip``, ``systemctl``, ``useradd``, ``userdel``, ``id``,
``chown``) are put first on PATH and record each call, one per line, arguments tab-separated; the
script's system paths go under ``FEDFLEET_ROOT``. The tests assert on those calls and on the files made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.provision import DeviceLayout, provision
from coordinator.provision.agent_kit import JETSON_INDEX, TORCH_CPU_INDEX, torch_version
from coordinator.provision.wheel import wheel_name
from tests.coordinator.provision.kit_fixtures import KINDS, kinds_fleet

UNIT = "fedfleet-agent.service"
MIRROR = "https://mirror.example/whl/cpu"

_LOG = 'printf "%s" "$(basename "$0")" >> "$FAKE_LOG"; printf "\\t%s" "$@" >> "$FAKE_LOG"; echo >> "$FAKE_LOG"\n'
STUBS = {
    "python3": _LOG
    + 'case "$1" in\n'
    + '-m) if [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$FAKE_BIN/venv-python" "$3/bin/python"; fi ;;\n'
    + "-c) case $2 in *'%d.%d'*) echo 3.11 ;; esac ;;\n"
    + "-V) echo Python 3.11.7 ;;\n"
    + "esac\n",
    # The venv's python: pip is the pip stub; torch imports once a pip call installed it.
    "venv-python": 'if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; exec "$FAKE_BIN/pip" "$@"; fi\n'
    + 'case $2 in *"import torch"*)\n'
    + '    [ -e "$FAKE_STATE/torch" ] || { echo "ModuleNotFoundError: No module named torch" >&2; exit 1; }\n'
    + "    case $2 in *print*) echo 2.13.0+cpu ;; esac ;;\n"
    + "esac\n",
    "pip": _LOG
    + 'prev=""\n'
    + 'for arg in "$@"; do\n'
    + '    if [ "$prev" = --index-url ]; then\n'
    + "        for down in $FAKE_UNREACHABLE; do\n"
    + '            if [ "$arg" = "$down" ]; then echo "ERROR: Could not fetch URL $arg (fake)" >&2; exit 1; fi\n'
    + "        done\n"
    + "    fi\n"
    + '    case $arg in torch|torch==*) touch "$FAKE_STATE/torch" ;; esac\n'
    + "    prev=$arg\n"
    + "done\n",
    "id": 'if [ "$1" = -u ]; then echo 0; exit 0; fi\n[ -e "$FAKE_STATE/user-$1" ]\n',
    "useradd": _LOG + 'for last in "$@"; do :; done; touch "$FAKE_STATE/user-$last"\n',
    "userdel": _LOG + 'rm -f "$FAKE_STATE/user-$1"\n',
    "chown": _LOG,
    "systemctl": _LOG,
}


@dataclass
class Result:
    code: int
    out: str
    err: str
    calls: list[list[str]]

    def of(self, command: str) -> list[list[str]]:
        return [c[1:] for c in self.calls if c[0] == command]

    def torch_installs(self) -> list[list[str]]:
        return [c for c in self.of("pip") if any(a == "torch" or a.startswith("torch==") for a in c)]


class Device:
    """One kit copied into a test's folder, a fake root beside it, the stubs and their record."""

    def __init__(self, kit: Path, tmp: Path, machine: str = "x86_64", systemd: bool = True) -> None:
        self.kit = Path(shutil.copytree(kit, tmp / "kit"))
        self.root = tmp / "root"
        self.bin = tmp / "bin"
        self.state = tmp / "stub-state"
        self.log = tmp / "calls.log"
        for folder in (self.root, self.bin, self.state):
            folder.mkdir()
        if systemd:
            (self.root / "run" / "systemd" / "system").mkdir(parents=True)
            (self.root / "etc" / "systemd" / "system").mkdir(parents=True)
        for name, body in STUBS.items():
            (self.bin / name).write_text("#!/bin/bash\n" + body)
            (self.bin / name).chmod(0o755)
        self.env = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "HOME": str(tmp),
            "FEDFLEET_ROOT": str(self.root),
            "FEDFLEET_MACHINE": machine,
            "FAKE_BIN": str(self.bin),
            "FAKE_STATE": str(self.state),
            "FAKE_LOG": str(self.log),
        }

    def path(self, system_path: str) -> Path:
        return self.root / system_path.lstrip("/")

    def run(self, script: str = "install.sh", *args: str, **env: str) -> Result:
        self.log.write_text("")
        done = subprocess.run(
            ["bash", str(self.kit / script), *args],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            cwd="/",
            timeout=60,
        )
        calls = [line.split("\t") for line in self.log.read_text().splitlines()]
        return Result(done.returncode, done.stdout, done.stderr, calls)

    def wheels(self, *names: str) -> None:
        (self.kit / "wheels").mkdir()
        for name in names:
            (self.kit / "wheels" / name).write_bytes(b"")


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A provisioned fleet (default device paths) with a laptop, a Pi, a Jetson and an NVIDIA laptop."""
    root = tmp_path_factory.mktemp("install-kits")
    return provision(kinds_fleet(root), root / "kits", (), DeviceLayout()).kits.root


def _no_cuda(result: Result) -> None:
    """No pip call names a CUDA package (options and the kit's paths aside)."""
    names = [a.lower() for call in result.of("pip") for a in call if not a.startswith(("-", "/", "http"))]
    assert names and not [n for n in names if "nvidia" in n or "triton" in n or "cuda" in n]


def test_a_laptop_gets_the_pinned_cpu_torch_its_deps_the_agent_and_a_service(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "laptop", tmp_path)
    result = device.run(FEDFLEET_PIP=str(device.bin / "pip"))
    assert result.code == 0, result.err
    pins = f"torch=={torch_version()}"
    assert "+" not in pins and result.of("python3")[-1] == ["-m", "venv", str(device.path("/opt/fedfleet/venv"))]
    pip = result.of("pip")
    assert pip[0] == ["install", "--no-deps", "--retries", "1", "--timeout", "30", "--index-url", TORCH_CPU_INDEX, pins]
    assert pip[1][:2] == ["install", "filelock"] and "sympy>=1.13.3" in pip[1]
    assert pip[2] == ["install", f"{device.kit}/{wheel_name()}[demo]"]
    _no_cuda(result)
    assert f"torch: CPU build from {TORCH_CPU_INDEX} (no NVIDIA packages)" in result.out
    assert result.of("useradd") == [
        ["--system", "--home-dir", "/var/lib/fedfleet", "--shell", "/usr/sbin/nologin", "fedfleet"]
    ]
    state = device.path("/var/lib/fedfleet")
    assert state.is_dir() and state.stat().st_mode & 0o777 == 0o750
    assert ["fedfleet:fedfleet", str(state)] in result.of("chown")
    assert ["fedfleet:fedfleet", str(device.path("/opt/fedfleet/etc/password"))] in result.of("chown")
    assert device.path("/opt/fedfleet/etc/password").stat().st_mode & 0o777 == 0o600
    for secret in ("doctor.password", "doctor.key"):  # doctor's read-only login, named by agent.yaml's broker.doctor
        assert ["fedfleet:fedfleet", str(device.path(f"/opt/fedfleet/etc/{secret}"))] in result.of("chown")
        assert device.path(f"/opt/fedfleet/etc/{secret}").stat().st_mode & 0o777 == 0o600
    assert device.path("/opt/fedfleet/etc/doctor.pem").stat().st_mode & 0o777 == 0o644
    assert device.path("/opt/fedfleet/etc/agent.yaml").stat().st_mode & 0o777 == 0o644
    assert (device.path("/etc/systemd/system") / UNIT).read_text() == (device.kit / UNIT).read_text()
    assert result.of("systemctl") == [["daemon-reload"]]
    assert "then start:        systemctl enable --now fedfleet-agent" in result.out


def test_a_pi_gets_the_cpu_build_when_the_cpu_index_is_reachable(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "pi", tmp_path, machine="aarch64")
    result = device.run()
    assert result.code == 0, result.err
    cpu_index = ["--index-url", TORCH_CPU_INDEX, f"torch=={torch_version()}"]
    assert result.torch_installs() == [["install", "--no-deps", "--retries", "1", "--timeout", "30", *cpu_index]]
    _no_cuda(result)


def test_a_pi_falls_back_to_the_next_cpu_index_and_never_to_pypis_cuda_torch(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "pi", tmp_path, machine="aarch64")
    result = device.run(TORCH_CPU_INDEX=f"{TORCH_CPU_INDEX} {MIRROR}", FAKE_UNREACHABLE=TORCH_CPU_INDEX)
    assert result.code == 0, result.err
    assert [c[c.index("--index-url") + 1] for c in result.torch_installs()] == [TORCH_CPU_INDEX, MIRROR]
    assert all("--no-deps" in c for c in result.torch_installs())
    assert f"torch: {TORCH_CPU_INDEX} failed" in result.err
    assert f"torch: CPU build from {MIRROR} (no NVIDIA packages)" in result.out
    _no_cuda(result)


def test_a_pi_with_no_cpu_index_reachable_stops_with_how_to_get_the_wheel(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "pi", tmp_path, machine="aarch64")
    result = device.run(FAKE_UNREACHABLE=TORCH_CPU_INDEX)
    assert result.code == 3
    assert len(result.torch_installs()) == 1 and "--index-url" in result.torch_installs()[0]  # nothing from PyPI
    _no_cuda(result)
    assert "--platform manylinux_2_28_aarch64" in result.err and "--python-version 3.11" in result.err
    assert f"-d wheels torch=={torch_version()}" in result.err and "TORCH_CPU_INDEX=<a mirror of" in result.err
    assert not result.of("useradd")


def test_a_kit_with_wheels_installs_offline(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "pi", tmp_path, machine="aarch64")
    device.wheels(f"torch-{torch_version()}+cpu-cp311-cp311-manylinux_2_28_aarch64.whl", "numpy-2.0.0-cp311.whl")
    result = device.run()
    assert result.code == 0, result.err
    wheels = str(device.kit / "wheels")
    assert result.of("pip") and all(c[1:4] == ["--no-index", "--find-links", wheels] for c in result.of("pip"))
    assert not any("--index-url" in c for c in result.of("pip"))
    assert result.torch_installs()[0][-2:] == ["--no-deps", "torch"]  # the kit's torch, whatever its version
    name = f"torch-{torch_version()}+cpu-cp311-cp311-manylinux_2_28_aarch64.whl"
    assert f"torch: CPU build from the kit's wheels/ ({name}) (no NVIDIA packages)" in result.out


def test_without_systemd_it_makes_the_user_and_state_dir_and_says_how_to_start(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "laptop", tmp_path, systemd=False)
    result = device.run()
    assert result.code == 0, result.err
    assert result.of("useradd") and not result.of("systemctl")
    state = device.path("/var/lib/fedfleet")
    assert state.stat().st_mode & 0o777 == 0o750 and ["fedfleet:fedfleet", str(state)] in result.of("chown")
    assert "systemd is not running here: the unit was not enabled (not copied)." in result.out
    command = "/opt/fedfleet/venv/bin/device-agent run --config /opt/fedfleet/etc/agent.yaml"
    assert f"start the agent by hand: su -s /bin/sh fedfleet -c '{command}'" in result.out


def test_running_it_again_keeps_the_user_venv_torch_and_state(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "pi", tmp_path, machine="aarch64")
    assert device.run().code == 0
    (device.path("/var/lib/fedfleet") / "outbox").mkdir()
    again = device.run()
    assert again.code == 0, again.err
    assert not [c for c in again.of("python3") if c[:2] == ["-m", "venv"]] and "(already there)" in again.out
    assert not again.of("useradd") and not again.torch_installs()
    assert "torch: already installed in" in again.out and "(2.13.0+cpu; the kit pins" in again.out
    assert (device.path("/var/lib/fedfleet") / "outbox").is_dir()
    assert again.of("pip") == [["install", f"{device.kit}/{wheel_name()}[demo]"]]


def test_a_jetson_without_nvidias_wheel_stops_with_the_instruction(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "orin", tmp_path, machine="aarch64")
    device.path("/etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.0\n")
    result = device.run()
    assert result.code == 2 and "parameter not set" not in result.err
    assert f"into {device.kit}/wheels/ (from {JETSON_INDEX} for JetPack 6" in result.err
    assert f"sudo TORCH_INDEX_URL={JETSON_INDEX} sh {device.kit}/install.sh" in result.err
    assert not result.of("pip")


def test_a_jetson_installs_nvidias_wheel_from_the_kit(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "orin", tmp_path, machine="aarch64")
    device.path("/etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.0\n")
    device.wheels("torch-2.5.0a0+872d972e41.nv24.08-cp310-cp310-linux_aarch64.whl")
    result = device.run()
    assert result.code == 0, result.err
    pip = result.of("pip")
    assert pip[0] == ["install", "--no-index", "--find-links", str(device.kit / "wheels"), "--no-deps", "torch"]
    assert pip[1][:2] == ["install", "filelock"]  # only torch in wheels/: the rest from the index
    _no_cuda(result)
    assert "usermod -aG video fedfleet" not in result.out  # systemd runs it with SupplementaryGroups=video


def test_a_cuda_laptop_gets_pypis_torch_pinned(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "gpu", tmp_path)
    result = device.run()
    assert result.code == 0, result.err
    assert result.torch_installs() == [["install", f"torch=={torch_version()}"]]
    assert "torch: from pip's index, PyPI unless configured otherwise (cuda)\n" in result.out


def test_where_pip_may_have_taken_torch_from_is_said_beside_the_index_asked_for(kits: Path, tmp_path: Path) -> None:
    """pip adds its own settings' sources to the command line's: the script names them instead of claiming one."""
    device = Device(kits / "laptop", tmp_path)
    (tmp_path / ".config" / "pip").mkdir(parents=True)
    (tmp_path / ".config" / "pip" / "pip.conf").write_text("[global]\nfind-links = /srv/wheels\n")
    result = device.run(FEDFLEET_PIP=str(device.bin / "pip"), PIP_EXTRA_INDEX_URL="https://mirror.example/simple")
    assert result.code == 0, result.err
    assert (
        f"torch: CPU build from {TORCH_CPU_INDEX} (no NVIDIA packages); pip's own settings may have supplied it "
        f"instead: PIP_EXTRA_INDEX_URL=https://mirror.example/simple {tmp_path}/.config/pip/pip.conf\n"
    ) in result.out
    gpu = Device(kits / "gpu", tmp_path / "gpu-device")
    result = gpu.run(PIP_INDEX_URL=MIRROR)
    assert (
        "torch: from pip's index, PyPI unless configured otherwise (cuda); pip's own settings may have " in result.out
    )
    assert f"PIP_INDEX_URL={MIRROR}" in result.out


def test_uninstall_removes_the_unit_and_venv_and_keeps_the_state_unless_purged(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "laptop", tmp_path)
    assert device.run().code == 0
    unit, venv = device.path("/etc/systemd/system") / UNIT, device.path("/opt/fedfleet/venv")
    etc, state = device.path("/opt/fedfleet/etc"), device.path("/var/lib/fedfleet")
    result = device.run("uninstall.sh")
    assert result.code == 0, result.err
    assert result.of("systemctl") == [["disable", "--now", "fedfleet-agent"], ["daemon-reload"]]
    assert not unit.exists() and not venv.exists() and (etc / "password").exists() and state.is_dir()
    purged = device.run("uninstall.sh", "--purge")
    assert purged.code == 0, purged.err
    assert not etc.exists() and not state.exists() and purged.of("userdel") == [["fedfleet"]]
    assert device.run("uninstall.sh", "--keep").code == 2


@pytest.mark.parametrize("script", ["install.sh", "uninstall.sh"])
@pytest.mark.parametrize("kit", sorted(KINDS))
def test_the_scripts_parse_and_pass_shellcheck(kits: Path, kit: str, script: str) -> None:
    path = kits / kit / script
    assert os.access(path, os.X_OK)
    for shell in ("bash", "sh"):
        done = subprocess.run([shell, "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    done = subprocess.run(["shellcheck", "-s", "sh", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
