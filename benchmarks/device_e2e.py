"""A provisioned kit installs and trains on arm64 Debian bookworm (Raspberry Pi OS 12's base), under qemu-user.

What it does, as root (``make device-e2e``):

1. Checks the prerequisites (root, qemu-user-static with binfmt_misc, debootstrap, ``ip netns``, chroot,
   mosquitto) and names each missing one with the command that fixes it.
2. Builds (once, cached under ``~/.cache/fedfleet``) a ``debootstrap --arch arm64 --variant=minbase``
   bookworm root with python3, python3-venv and ca-certificates, and downloads the aarch64 wheels the
   kit needs with ``coordinator provision --wheels``'s code (:mod:`coordinator.provision.device_wheels`):
   a CPU-only torch (:data:`~coordinator.provision.device_wheels.DEVICE_TORCH`) and the agent's dependencies.
3. ``coordinator provision``s a two-device fleet: ``pi5-01`` (raspberry-pi-5) and ``laptop-01`` (x86).
   The broker listens on a veth address listed in ``broker.hosts`` (not loopback); the other end of
   the veth is in a network namespace of its own, which has no other route anywhere.
4. Copies pi5-01's kit, with the wheels in ``wheels/``, into a copy of the root and runs the kit's own
   ``install.sh`` there, unchanged, inside the namespace (offline: nothing but the kit).
5. Starts the coordinator on this host and the two agents: laptop-01 on this host, pi5-01 as its
   systemd unit would run it (its user, its ExecStart) but with ``ip netns exec NS chroot ROOT``,
   every arm64 instruction emulated by qemu, after ``device-agent doctor`` and ``device-agent probe``
   ran there as that user (what they report goes into the output). It waits for ``--rounds`` rounds and
   prints install time, kit size, installed venv size and the seconds per round (JSON with ``--json``).
6. With ``--jetson``, first: a Jetson kit (``provision --wheels``: no torch in wheels/) in another copy of
   the root with ``/etc/nv_tegra_release``; its install.sh must stop with the instruction for NVIDIA's wheel.

Everything it creates (namespace, veth, mounts, processes, the root's copy) goes on exit, failure included.

    sudo python -m benchmarks.device_e2e [--rounds 2] [--json] [--keep] [--jetson]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.netns import Namespace, netns_problem, run
from coordinator.config.fleet import load_fleet
from coordinator.provision.agent_kit import JETSON_INDEX, UNIT, torch_version
from coordinator.provision.device_wheels import CACHE, WheelOptions, download, fill_kit, platform_of
from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto

_ROOT = Path(__file__).resolve().parents[1]
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
PI, LAPTOP, ORIN = "pi5-01", "laptop-01", "orin-01"
HOST_IP, DEVICE_IP = "10.213.0.1", "10.213.0.2"
# The emulated CPU: a Raspberry Pi 5's core. qemu-user's default ("max") has SVE and SME, and torch's kernels
# for them run ~17x slower under emulation (a 512x512 matmul: 35 s, against 2 s as a Cortex-A76).
QEMU_CPU = "cortex-a76"
# A Raspberry Pi 5's MIDR_EL1 (Cortex-A76 r4p1): qemu-user does not fake /sys, and torch's cpuinfo reads it.
MIDR = "0x00000000414fd0b1"


def log(message: str) -> None:
    print(f"[device-e2e] {message}", file=sys.stderr, flush=True)


def missing_prerequisites() -> list[str]:
    """What this machine lacks, each with the command that fixes it (empty: ready)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root: run as root (sudo make device-e2e): chroot, mounts and network namespaces need it")
    if shutil.which("qemu-aarch64-static") is None:
        missing.append("qemu-user-static: apt-get install -y qemu-user-static binfmt-support")
    binfmt = Path("/proc/sys/fs/binfmt_misc")
    if not (binfmt / "status").exists():
        missing.append("binfmt_misc is not mounted: mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc")
    elif not (binfmt / "qemu-aarch64").exists() or "enabled" not in (binfmt / "qemu-aarch64").read_text():
        missing.append("no enabled qemu-aarch64 binfmt handler: update-binfmts --enable qemu-aarch64")
    elif "F" not in _binfmt_flags(binfmt / "qemu-aarch64"):
        missing.append(
            "the qemu-aarch64 binfmt handler lacks flag F (needed inside a chroot): reinstall qemu-user-static"
        )
    for tool, package in (("debootstrap", "debootstrap"), ("ip", "iproute2"), ("chroot", "coreutils")):
        if shutil.which(tool) is None:
            missing.append(f"{tool}: apt-get install -y {package}")
    if shutil.which("ip") is not None and os.geteuid() == 0 and (problem := netns_problem()) is not None:
        missing.append(problem)
    if find_mosquitto() is None:
        missing.append("mosquitto (the fleet's TLS broker): apt-get install -y mosquitto")
    return missing


def _binfmt_flags(entry: Path) -> str:
    return next(
        (line.split(":", 1)[1].strip() for line in entry.read_text().splitlines() if line.startswith("flags:")), ""
    )


def rootfs(cache: Path) -> Path:
    """The pristine bookworm arm64 root, built once (a few minutes: debootstrap's second stage runs under qemu)."""
    root = cache / f"rootfs-{SUITE}-arm64"
    if (root / "usr" / "bin" / "python3").exists():
        log(f"rootfs: {root} (cached)")
        return root
    partial = cache / f"rootfs-{SUITE}-arm64.partial"
    shutil.rmtree(partial, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    log(f"rootfs: debootstrap {SUITE} arm64 minbase into {root} (once; several minutes)")
    started = time.monotonic()
    include = ",".join(PACKAGES)
    run(["debootstrap", "--arch", "arm64", "--variant=minbase", f"--include={include}", SUITE, str(partial), MIRROR])
    partial.rename(root)
    log(f"rootfs: built in {time.monotonic() - started:.0f} s")
    return root


def fleet_yaml(port: int, rounds: int) -> str:
    return (
        "fleet: device-e2e\n"
        f"transport: {{broker: {{mode: managed, host: {HOST_IP}, port: {port}, hosts: [{HOST_IP}]}}}}\n"
        "model: {arch: cnn, num_classes: 10}\n"
        "dataset: {name: digits, partition: iid}\n"
        f"ratios: [1, 1/2]\nrounds: {rounds}\nround_deadline_s: 1800\nquorum: 1.0\n"
        "training: {batch_size: 32, local_epochs: 1, lr: 0.05}\n"
        f"devices:\n  - {{id: {PI}, profile: raspberry-pi-5}}\n  - {{id: {LAPTOP}, profile: x86-laptop-cpu}}\n"
    )


def du(path: Path) -> int:
    """Bytes of the files under ``path`` (symlinks not followed)."""
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def exec_start(unit: Path) -> list[str]:
    line = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def unit_user(unit: Path) -> str:
    return next(x for x in unit.read_text().splitlines() if x.startswith("User=")).removeprefix("User=")


def passwd_ids(root: Path, user: str) -> str:
    """``uid:gid`` of ``user`` in the root's /etc/passwd (chroot --userspec with names would look on this host)."""
    for line in (root / "etc" / "passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user:
            return f"{fields[2]}:{fields[3]}"
    raise RuntimeError(f"install.sh did not create user {user} in {root}/etc/passwd")


@contextlib.contextmanager
def mounted(root: Path) -> Iterator[None]:
    """/proc and /dev from this host; /sys a small tmpfs with the ARM CPU files torch's cpuinfo reads."""
    done: list[Path] = []
    try:
        for target, command in (
            (root / "proc", ["mount", "-t", "proc", "proc"]),
            (root / "dev", ["mount", "--rbind", "/dev"]),
            (root / "sys", ["mount", "-t", "tmpfs", "-o", "mode=0755", "sysfs-stand-in"]),
        ):
            target.mkdir(exist_ok=True)
            run([*command, str(target)])
            done.append(target)
        fake_sys(root / "sys", os.cpu_count() or 1)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-R", "-l", str(target)], capture_output=True)


def fake_sys(sys_dir: Path, cpus: int) -> None:
    cpu = sys_dir / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    span = "0" if cpus == 1 else f"0-{cpus - 1}"
    for name in ("possible", "present", "online"):
        (cpu / name).write_text(span + "\n")
    for index in range(cpus):
        ident = cpu / f"cpu{index}" / "regs" / "identification"
        ident.mkdir(parents=True)
        (ident / "midr_el1").write_text(MIDR + "\n")
        (ident / "revidr_el1").write_text("0x0000000000000000\n")


def chroot(root: Path, command: list[str], env: dict[str, str], userspec: str | None = None) -> list[str]:
    user = [f"--userspec={userspec}"] if userspec else []
    variables = [f"{k}={v}" for k, v in env.items()]
    return ["chroot", *user, str(root), "/usr/bin/env", "-i", *variables, *command]


def seconds_per_round(run_dir: Path) -> list[dict[str, object]]:
    rounds = []
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        record = json.loads(line)
        pi = record.get("devices", {}).get(PI, {})
        rounds.append(
            {
                "round": record["round"],
                "seconds": round(record["seconds"], 1),
                "pi_status": pi.get("status"),
                "pi_train_seconds": pi.get("train_seconds") and round(pi["train_seconds"], 1),
                "accuracy": record.get("accuracy"),
            }
        )
    return rounds


def jetson_yaml(port: int) -> str:
    """A one-Jetson fleet for the ``--jetson`` check (its kit is installed, never run)."""
    return (
        "fleet: device-e2e-jetson\n"
        f"transport: {{broker: {{mode: managed, host: {HOST_IP}, port: {port}, hosts: [{HOST_IP}]}}}}\n"
        f"dataset: {{name: digits}}\ndevices:\n  - {{id: {ORIN}, profile: jetson-orin-nano-8gb}}\n"
    )


def jetson_check(pristine: Path, cache: Path, work: Path, timeout: float) -> dict[str, object]:
    """A Jetson kit's install.sh, with no torch in wheels/, on arm64 with /etc/nv_tegra_release: it must stop
    (exit 2) with the instruction for NVIDIA's wheel, before installing anything else."""
    folder = work / "jetson"
    folder.mkdir()
    (folder / "fleet.yaml").write_text(jetson_yaml(free_port()))
    provision = [sys.executable, "-m", "coordinator", "provision", "--fleet", str(folder / "fleet.yaml")]
    run([*provision, "--out", str(folder / "kits"), "--wheels", "--wheels-cache", str(cache)], cwd=work)
    wheels = sorted(p.name for p in (folder / "kits" / ORIN / "wheels").glob("*.whl"))
    if any(name.startswith("torch-") for name in wheels):
        raise RuntimeError(f"the Jetson kit carries a torch wheel: {wheels}")
    root = folder / "rootfs"
    run(["cp", "-a", "--reflink=auto", str(pristine), str(root)])
    (root / "etc" / "nv_tegra_release").write_text("# R36 (release), REVISION: 4.0, GCID: 0, BOARD: generic\n")
    shutil.copytree(folder / "kits" / ORIN, root / "root" / f"kit-{ORIN}")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "QEMU_CPU": QEMU_CPU}
    log(f"jetson: sh /root/kit-{ORIN}/install.sh in a root with /etc/nv_tegra_release, {len(wheels)} wheels, no torch")
    started = time.monotonic()
    with mounted(root):
        done = subprocess.run(
            chroot(root, ["sh", f"/root/kit-{ORIN}/install.sh"], env), capture_output=True, text=True, timeout=timeout
        )
    instruction = f"sudo TORCH_INDEX_URL={JETSON_INDEX} sh /root/kit-{ORIN}/install.sh"
    ok = done.returncode == 2 and instruction in done.stderr and not (root / "opt/fedfleet/etc").exists()
    if not ok:
        raise RuntimeError(
            f"the Jetson kit's install.sh exited {done.returncode}, not 2 with the instruction:\n"
            f"{done.stdout}{done.stderr}"
        )
    log(f"jetson: stopped as it should (exit 2) in {time.monotonic() - started:.0f} s")
    return {
        "jetson_kit_wheels": len(wheels),
        "jetson_install_exit": done.returncode,
        "jetson_install_seconds": round(time.monotonic() - started, 1),
        "jetson_instruction": done.stderr.strip().splitlines(),
    }


def agent_reports(root: Path, ns: Namespace, env: dict[str, str], userspec: str) -> dict[str, object]:
    """``device-agent doctor`` and ``probe`` in the root, as the unit's user with the kit's config."""
    agent, config = "/opt/fedfleet/venv/bin/device-agent", "/opt/fedfleet/etc/agent.yaml"
    doctor = subprocess.run(
        [*ns.prefix(), *chroot(root, [agent, "doctor", "--config", config], env, userspec)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    log(f"doctor (exit {doctor.returncode}):\n{doctor.stdout.strip()}")
    probe = subprocess.run(
        [*ns.prefix(), *chroot(root, [agent, "probe", "--json"], env, userspec)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if probe.returncode != 0:  # reported, not fatal: the rounds still show whether the agent trains
        log(f"probe exited {probe.returncode}:\n{probe.stderr[-2000:]}")
        return {"doctor_exit": doctor.returncode, "doctor": doctor.stdout.strip().splitlines(), "probe": None}
    profile = json.loads(probe.stdout)
    facts = {k: profile[k] for k in ("platform", "machine", "python", "torch", "cpu_count", "accelerator")}
    facts |= {
        "memory_total_mib": round(profile["memory_total_bytes"] / 2**20),
        "memory_available_mib": round(profile["memory_available_bytes"] / 2**20),
        "matmul_gflops": round(profile["matmul_gflops"], 3),
    }
    log(f"probe: {facts}")
    return {"doctor_exit": doctor.returncode, "doctor": doctor.stdout.strip().splitlines(), "probe": facts}


def measure(rounds: int, cache: Path, keep: bool, timeout: float, jetson: bool = False) -> dict[str, object]:
    pristine = rootfs(cache)
    work = Path(tempfile.mkdtemp(prefix="fedfleet-device-e2e-"))
    os.chmod(work, 0o711)  # mosquitto drops to its own user and must reach kits/broker
    processes: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}
    try:
        log(f"work dir: {work}")
        root = work / "rootfs"
        run(["cp", "-a", "--reflink=auto", str(pristine), str(root)])
        port = free_port()
        (work / "fleet.yaml").write_text(fleet_yaml(port, rounds))
        coordinator = [sys.executable, "-m", "coordinator"]
        run([*coordinator, "provision", "--fleet", str(work / "fleet.yaml"), "--out", str(work / "kits")], cwd=work)
        kits = work / "kits"
        kit = root / "root" / f"kit-{PI}"
        shutil.copytree(kits / PI, kit)
        fleet, _ = load_fleet(work / "fleet.yaml")
        platform = platform_of(next(d for d in fleet.devices if d.id == PI))
        assert platform is not None and platform.torch is not None
        log(f"wheels: {platform.label}, {platform.note} (cache {cache})")
        fill_kit(kit, download(fleet, platform, WheelOptions(cache)))
        kit_bytes, bundle_bytes = du(kit), (kits / f"{PI}.tar.gz").stat().st_size
        result: dict[str, object] = {
            "rootfs": f"debian {SUITE} arm64 minbase (qemu-aarch64 -cpu {QEMU_CPU})",
            "torch_pinned": torch_version(),
            "torch_in_kit": platform.torch,
            "kit_mib": round(kit_bytes / 2**20, 1),
            "kit_bundle_mib_without_wheels": round(bundle_bytes / 2**20, 2),
            "rounds_asked": rounds,
        }
        if jetson:
            result |= jetson_check(pristine, cache, work, timeout)
        with Namespace("fedfleet-e2e", "ffe2e", HOST_IP, DEVICE_IP) as ns, mounted(root):
            path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
            # QEMU_CPU reaches every arm64 process only if each environment carries it (env -i clears the rest).
            env = {"PATH": path, "HOME": "/root", "LANG": "C.UTF-8", "QEMU_CPU": QEMU_CPU}
            env["FEDFLEET_OFFLINE"] = "1"
            log(f"install: sh /root/kit-{PI}/install.sh in the chroot, in namespace {ns.name} (offline), under qemu")
            started = time.monotonic()
            install = subprocess.run(
                [*ns.prefix(), *chroot(root, ["sh", f"/root/kit-{PI}/install.sh"], env)],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            result["install_seconds"] = round(time.monotonic() - started, 1)
            (work / "install.log").write_text(install.stdout + install.stderr)
            if install.returncode != 0:
                raise RuntimeError(
                    f"install.sh exited {install.returncode}:\n{(install.stdout + install.stderr)[-4000:]}"
                )
            log(f"install: done in {result['install_seconds']} s; it says: {install.stdout.strip().splitlines()[-1]}")
            result["venv_mib"] = round(du(root / "opt" / "fedfleet" / "venv") / 2**20, 1)

            def spawn(name: str, command: list[str]) -> None:
                logs[name] = work / f"{name}.log"
                processes[name] = subprocess.Popen(
                    command, cwd="/", stdout=logs[name].open("wb"), stderr=subprocess.STDOUT
                )

            run_dir = work / "run"
            spawn(
                "coordinator",
                [
                    *coordinator,
                    *("start", "--fleet", str(work / "fleet.yaml"), "--kits", str(kits), "--run-dir", str(run_dir)),
                    *("--no-live", "--min-devices", "2", "--wait-timeout", str(int(timeout))),
                ],
            )
            deadline = time.monotonic() + 60
            while "broker: mqtts://" not in logs["coordinator"].read_text():
                if processes["coordinator"].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the coordinator did not start its broker:\n{logs['coordinator'].read_text()}")
                time.sleep(0.2)
            unit = kit / UNIT
            userspec = passwd_ids(root, unit_user(unit))
            unit_env = {"PATH": path, "HOME": "/var/lib/fedfleet", "LANG": "C.UTF-8", "QEMU_CPU": QEMU_CPU}
            unit_env["PYTHONUNBUFFERED"] = "1"  # the unit's Environment=
            result |= agent_reports(root, ns, unit_env, userspec)
            log(f"agent {PI}: {shlex.join(exec_start(unit))} as {unit_user(unit)} ({userspec}), chroot + netns")
            started = time.monotonic()
            spawn(PI, [*ns.prefix(), *chroot(root, exec_start(unit), unit_env, userspec)])
            laptop = kits / LAPTOP
            spawn(
                LAPTOP,
                [
                    *(sys.executable, "-m", "device_agent", "run", "--config", str(laptop / "agent.yaml")),
                    *("--password", f"file:{laptop / 'password'}", "--ca-file", str(laptop / "ca.pem")),
                    *("--cert-file", str(laptop / "client.pem"), "--key-file", str(laptop / "client.key")),
                    *("--state-dir", str(work / f"state-{LAPTOP}")),
                ],
            )
            deadline = time.monotonic() + timeout
            while processes["coordinator"].poll() is None and time.monotonic() < deadline:
                if processes[PI].poll() is not None:
                    raise RuntimeError(f"agent {PI} exited {processes[PI].returncode}:\n{logs[PI].read_text()[-4000:]}")
                time.sleep(1)
            result["run_seconds"] = round(time.monotonic() - started, 1)
            output = logs["coordinator"].read_text()
            per_round = seconds_per_round(run_dir)
            completed = [r for r in per_round if r["pi_status"] == "accepted"]
            result |= {
                "rounds_completed": len(completed),
                "seconds_per_round": [r["seconds"] for r in per_round],
                "pi_train_seconds_per_round": [r["pi_train_seconds"] for r in per_round],
                "rounds": per_round,
                "coordinator_exit": processes["coordinator"].returncode,
            }
            if processes["coordinator"].returncode != 0 or len(completed) < rounds:
                log(f"coordinator output (tail):\n{output[-3000:]}\n{PI} (tail):\n{logs[PI].read_text()[-3000:]}")
        return result
    finally:
        for name, process in processes.items():
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    log(f"{name} ignored SIGTERM: killing it")
                    process.kill()
                    process.wait()
        if keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"rootfs and wheels cache (default {CACHE})")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (rootfs copy, kits, logs)")
    parser.add_argument("--timeout", type=float, default=2400, help="seconds for the install and for the rounds")
    parser.add_argument("--jetson", action="store_true", help="also check a Jetson kit stops for NVIDIA's torch")
    args = parser.parse_args(argv)
    # A SIGTERM (a test runner's timeout, kill) unwinds like an error: the finally blocks remove the
    # namespace, the veth, the mounts and the processes. (A background job of a shell ignores SIGINT.)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    missing = missing_prerequisites()
    if missing:
        print("device-e2e cannot run here; missing:\n  - " + "\n  - ".join(missing), file=sys.stderr)
        return 2
    result = measure(args.rounds, args.cache, args.keep, args.timeout, args.jetson)
    result["coordinator_version"] = importlib.metadata.version("fedfleet")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            if key not in ("rounds", "doctor", "jetson_instruction"):
                print(f"{key:32} {value}")
    ok = result["rounds_completed"] >= args.rounds and result["coordinator_exit"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
