"""Run-time faults against a real emulated fleet: does the run survive, and is any update lost?

Every scenario runs ``coordinator emulate`` (the real coordinator, its supervised mosquitto and one
``device-agent run`` process per device) on a small digits fleet in a folder of its own, injects a
fault with real signals, restarts what a person or systemd would restart, and lets the run finish::

    python -m benchmarks.faults --json
    python -m benchmarks.faults --scenarios agent,coordinator --repeats 1 --json
    python -m benchmarks.faults --page docs/reliability.md  # also rewrite the reliability tables there

By default the kinds of hostile input of :mod:`benchmarks.bad_inputs` are tried too (key ``bad_inputs``;
``--no-bad-inputs`` skips them).

An update is *lost* when its agent logged the coordinator's receipt ``accepted`` (or ``duplicate``,
which says it was accepted before) for a round whose metrics do not count that device as accepted:
the device dropped the update believing it counted. "Mid-upload" means the agent's outbox holds a
finished update the coordinator has not acknowledged (each device's uplink is held to 2 Mbit/s, so
an upload takes about a second). Leftovers (a broker still listening, broker scratch folders of
exited coordinators) make a scenario fail too.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from benchmarks import bad_inputs
from benchmarks.reliability import update_page
from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.scratch import OWNER_FILE, PATTERN
from device_agent.common.processes import die_with_parent
from device_agent.emulation.launcher import agent_command
from device_agent.emulation.limits import thread_env

DEVICES = ("orin-01", "orin-02", "pi5-01", "pi5-02")
FLEET = """\
fleet: {name}
transport: {{broker: {{mode: managed, host: 127.0.0.1, port: {port}}}}}
model: {{arch: cnn, num_classes: 10}}
dataset: {{name: digits, partition: dirichlet(1.0), seed: 0}}
strategy: {{name: fedhm}}
ratios: [1, 1/2]
rounds: {rounds}
round_deadline_s: {deadline}
quorum: 0.5
checkpoints: {{keep_last: 2, keep_best: true}}
training: {{batch_size: 16, local_epochs: 1, lr: 0.05, optimizer: momentum}}
devices:
{devices}"""
# A device's profile by its name: "orin-NN" a Jetson Orin Nano, "pi5-NN" a Raspberry Pi 5 at gamma 1/2.
PROFILES = {
    "orin": "profile: jetson-orin-nano-8gb, overrides: {network: {uplink_mbps: 2}}",
    "pi5": "profile: raspberry-pi-5, overrides: {max_ratio: 1/2, network: {uplink_mbps: 2}}",
}


def fleet_yaml(name: str, port: int, rounds: int, deadline_s: float, devices: tuple[str, ...]) -> str:
    """The fleet of a fault run: digits, FedHM, every uplink held to 2 Mbit/s (an upload lasts about a second)."""
    lines = "".join(f"  - {{id: {d}, {PROFILES[d.split('-')[0]]}}}\n" for d in devices)
    return FLEET.format(name=name, port=port, rounds=rounds, deadline=deadline_s, devices=lines)


SETTLED = re.compile(r"(\S+): round (\d+) update settled \(receipt: (accepted|duplicate)\)")
WAIT_S = 150.0  # generous: on a loaded 2-core host every process start imports torch for seconds
DEADLINE_S = 12.0
AGENT_EXIT_S = 30.0  # PR_SET_PDEATHSIG sends SIGTERM at once; a loaded host may take seconds to schedule the exits


class ScenarioFailed(Exception):
    """A fault scenario that could not go on (a timeout, a process that would not start)."""


@dataclass
class Outcome:
    survived: bool | None  # None: not run here (e.g. no way to make a full disk)
    lost_updates: int
    rounds_completed: int
    detail: str


class FleetRun:
    """One scenario's folder (fleet.yaml, kits, run directory) and the processes of its run."""

    def __init__(
        self,
        root: Path,
        rounds: int,
        deadline_s: float,
        devices: tuple[str, ...] = DEVICES,
        run_args: tuple[str, ...] = (),
        name: str = "faults",
    ) -> None:
        """``run_args``: more ``coordinator emulate`` options, on every start (a resume is the same command)."""
        self.root = root
        self.rounds = rounds
        self.devices = devices
        self.run_args = run_args
        self.port = free_port()
        self.fleet_file = root / "fleet.yaml"
        self.fleet_file.write_text(fleet_yaml(name, self.port, rounds, deadline_s, devices))
        self.run_dir = root / "run"
        self.coordinators: list[subprocess.Popen[bytes]] = []
        self.agents: list[subprocess.Popen[bytes]] = []

    # ---- processes -----------------------------------------------------------------------------

    def start_coordinator(self, *extra: str) -> subprocess.Popen[bytes]:
        """``coordinator emulate`` on this run; it gets SIGTERM (a clean stop of its agents and broker) if we die."""
        number = len(self.coordinators)
        command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(self.fleet_file)]
        command += ["--run-dir", str(self.run_dir), "--no-live", "--wait-timeout", "60", *self.run_args, *extra]
        with open(self.root / f"coordinator-{number}.out", "wb") as out, open(self.err_file(number), "wb") as err:
            process = subprocess.Popen(
                command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent
            )
        self.coordinators.append(process)
        return process

    def err_file(self, number: int) -> Path:
        return self.root / f"coordinator-{number}.err"

    def agent_pids(self) -> dict[str, int]:
        """Live agent processes of this run by device, whoever started them."""
        found = {}
        for process in psutil.process_iter(["pid", "cmdline"]):
            command = " ".join(process.info["cmdline"] or [])
            for device in self.devices:
                if str(self.run_dir / "agents" / device / "agent.yaml") in command:
                    found[device] = process.info["pid"]
        return found

    def restart_agent(self, device: str) -> subprocess.Popen[bytes]:
        """What systemd's Restart=on-failure does for a real device.

        The agent is this process's child, not the coordinator's: it dies with us (parent-death signal), but
        a scenario that kills the coordinator must stop it itself, as :meth:`stop_restarted` does.
        """
        config = self.run_dir / "agents" / device / "agent.yaml"
        with open(config.parent / "agent.log", "ab") as log:
            env = {**os.environ, **thread_env(1)}
            process = subprocess.Popen(
                agent_command(config),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.agents.append(process)
        return process

    def stop_restarted(self) -> None:
        """SIGTERM to the agents :meth:`restart_agent` started that still run: what the parent-death signal
        sends the coordinator's own agents when it is killed, so a killed coordinator leaves no device up."""
        for process in self.agents:
            if process.poll() is None:
                process.terminate()

    def broker_pid(self) -> int:
        return int((self.run_dir / "broker.pid").read_text().split()[0])

    def broker_restarted(self, old: int) -> bool:
        """Whether broker.pid names a broker other than ``old`` (False while it cannot be read)."""
        try:
            return self.broker_pid() != old
        except (OSError, ValueError, IndexError):
            return False

    def finish(self, coordinator: subprocess.Popen[bytes], timeout: float = WAIT_S) -> int:
        try:
            return coordinator.wait(timeout)
        except subprocess.TimeoutExpired:
            raise ScenarioFailed(f"the coordinator did not finish within {timeout:.0f} s") from None

    def stop_all(self) -> None:
        """End every process this scenario started that still runs (SIGTERM, then SIGKILL)."""
        for process in [*self.coordinators, *self.agents]:
            if process.poll() is None:
                process.terminate()
        for process in [*self.coordinators, *self.agents]:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    # ---- observing -----------------------------------------------------------------------------

    def rounds_completed(self) -> int:
        try:
            return int(json.loads((self.run_dir / "run.json").read_text())["last_completed_round"])
        except (OSError, ValueError, KeyError):
            return 0

    def pending(self, round_: int) -> list[str]:
        """Devices whose outbox holds a finished, unacknowledged update of ``round_``."""
        marker = f".r{round_:06d}."
        return [
            device
            for device in self.devices
            if any(marker in p.name for p in (self.run_dir / "agents" / device / "state" / "outbox").glob("*.json"))
        ]

    def wait_for(self, what: str, condition: Callable[[], object], timeout: float = WAIT_S) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            if self.coordinators and self.coordinators[-1].poll() is not None:
                raise ScenarioFailed(
                    f"the coordinator exited (status {self.coordinators[-1].returncode}) before {what}"
                )
            time.sleep(0.02)
        raise ScenarioFailed(f"timed out after {timeout:.0f} s waiting for {what}")

    def mid_upload(self, round_: int) -> list[str]:
        return self.wait_for(f"an upload of round {round_}", lambda: self.pending(round_))  # type: ignore[return-value]

    def acknowledged(self) -> set[tuple[str, int]]:
        """(device, round) of every update an agent logged as accepted by the coordinator."""
        acked = set()
        for device in self.devices:
            log = self.run_dir / "agents" / device / "agent.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            acked |= {(name, int(round_)) for name, round_, _status in SETTLED.findall(text)}
        return acked

    def _devices_by_round(self, judged: Callable[[dict], bool]) -> dict[int, set[str]]:
        found: dict[int, set[str]] = {}
        metrics = self.run_dir / "metrics.jsonl"
        for line in metrics.read_text().splitlines() if metrics.exists() else []:
            row = json.loads(line)
            found[row["round"]] = {d for d, m in row["devices"].items() if judged(m)}
        return found

    def refused_at_close(self) -> list[tuple[str, int]]:
        """Acknowledged updates the peer check refused when their round closed: judged, not lost (the metrics
        say ``rejected`` with the reason and the upload is kept in the run's quarantine)."""
        # An acknowledged update can only be rejected at its round's close, where the peer check judges.
        refused = self._devices_by_round(lambda m: m["status"] == "rejected" and m.get("reason") == "wrong_direction")
        return [(device, round_) for device, round_ in self.acknowledged() if device in refused.get(round_, set())]

    def lost_updates(self) -> int:
        """Updates an agent was told were accepted that the round's metrics neither count nor refused at the close."""
        accepted = self._devices_by_round(lambda m: m["status"] == "accepted")
        refused = set(self.refused_at_close())
        return sum(
            device not in accepted.get(round_, set()) and (device, round_) not in refused
            for device, round_ in self.acknowledged()
        )

    def leftovers(self) -> list[str]:
        """A broker still on our port, or scratch folders of our exited coordinators."""
        found = []
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", self.port))
            except OSError:
                found.append(f"something still listens on port {self.port}")
        ours = {str(p.pid) for p in self.coordinators}
        for folder in Path(tempfile.gettempdir()).glob(PATTERN):
            try:
                owner = (folder / OWNER_FILE).read_text().split()
            except OSError:
                continue
            if owner and owner[0] in ours:
                found.append(f"{folder} was left behind")
        return found

    def errors(self) -> list[str]:
        """Tracebacks the coordinator printed: every failure must be a one-line message."""
        return [
            f"coordinator-{n}.err has a traceback"
            for n in range(len(self.coordinators))
            if "Traceback" in self.err_file(n).read_text(errors="replace")
        ]

    def outcome(self, did: str) -> Outcome:
        lost, done, problems = self.lost_updates(), self.rounds_completed(), self.leftovers() + self.errors()
        survived = done == self.rounds and lost == 0 and not problems
        checked = f"{done}/{self.rounds} rounds, {len(self.acknowledged())} acknowledged updates checked"
        detail = "; ".join([did, checked, *problems])
        return Outcome(survived, lost, done, detail)


# ---- scenarios ---------------------------------------------------------------------------------


def kill_agents(run: FleetRun, repeats: int, half: bool) -> str:
    coordinator = run.start_coordinator()
    for round_ in range(1, repeats + 1):
        victims = run.mid_upload(round_)[:1]
        if half:
            victims += [d for d in run.devices if d not in victims][: len(run.devices) // 2 - 1]
        pids = run.agent_pids()
        for device in victims:
            os.kill(pids[device], signal.SIGKILL)
        psutil.wait_procs([psutil.Process(pids[d]) for d in victims if psutil.pid_exists(pids[d])], timeout=10)
        for device in victims:
            run.restart_agent(device)
        run.wait_for(f"round {round_} to close", lambda r=round_: run.rounds_completed() >= r)
    run.finish(coordinator)
    what = "half the fleet (one mid-upload)" if half else "one agent mid-upload"
    return f"kill -9 of {what} in rounds 1-{repeats}, restarted as systemd would"


def exited(process: psutil.Process) -> bool:
    """Gone, or a zombie: it has exited and only waits for a reaper (an orphan whose new parent, e.g. a
    container's first process, does not reap; ``wait_procs`` counts those as alive)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_coordinator(run: FleetRun, repeats: int) -> str:
    exits: list[float] = []
    for round_ in range(1, repeats + 1):
        coordinator = run.start_coordinator()
        run.mid_upload(round_)
        agents = [psutil.Process(pid) for pid in run.agent_pids().values()]
        coordinator.kill()
        coordinator.wait()
        killed = time.monotonic()
        _gone, alive = psutil.wait_procs(agents, timeout=AGENT_EXIT_S)
        alive = [p for p in alive if not exited(p)]
        if alive:
            raise ScenarioFailed(f"{len(alive)} agents outlived their killed coordinator by {AGENT_EXIT_S:.0f} s")
        exits.append(time.monotonic() - killed)
    run.finish(run.start_coordinator())
    again = run.start_coordinator()
    finished = (
        run.finish(again) == 0
        and "is complete" in (run.root / f"coordinator-{len(run.coordinators) - 1}.out").read_text()
    )
    return (
        f"kill -9 of the coordinator mid-upload in rounds 1-{repeats} (its agents gone within "
        f"{max(exits):.1f} s), resumed each time; "
        + (
            "resuming the finished run says it is complete (exit 0)"
            if finished
            else "**resuming the finished run did not say it is complete**"
        )
    )


def kill_broker(run: FleetRun, repeats: int, wipe: bool) -> str:
    coordinator = run.start_coordinator()
    for round_ in range(1, repeats + 1):
        run.mid_upload(round_)
        pid = run.broker_pid()
        if wipe:
            os.kill(pid, signal.SIGSTOP)  # frozen: it cannot write its persistence while we delete it
            for file in persistence_dir(pid).glob("*"):
                file.unlink()
        os.kill(pid, signal.SIGKILL)
        run.wait_for("the broker to be restarted", lambda p=pid: run.broker_restarted(p))
        run.wait_for(f"round {round_} to close", lambda r=round_: run.rounds_completed() >= r)
    run.finish(coordinator)
    restarts = (run.root / "coordinator-0.err").read_text(errors="replace").count("broker restarted")
    if wipe:
        return f"broker frozen, its persistence deleted (sessions lost), kill -9; supervisor restarts: {restarts}"
    return f"kill -9 of the broker mid-upload in rounds 1-{repeats}; supervisor restarts: {restarts}"


def persistence_dir(pid: int) -> Path:
    command = psutil.Process(pid).cmdline()
    config = Path(command[command.index("-c") + 1])
    location = re.search(r"^persistence_location\s+(\S+)", config.read_text(), flags=re.MULTILINE)
    if location is None:
        raise ScenarioFailed(f"{config} has no persistence_location")
    return Path(location.group(1))


def offline_past_deadline(run: FleetRun, deadline_s: float) -> str:
    coordinator = run.start_coordinator()
    run.wait_for("round 1 to close", lambda: run.rounds_completed() >= 1)
    device = run.devices[-1]
    agent = psutil.Process(run.agent_pids()[device])
    agent.suspend()  # no network, no CPU: from the broker's side the device is gone
    time.sleep(deadline_s + 3)
    agent.resume()
    back = run.rounds_completed()
    run.finish(coordinator)
    rejoined = [
        row["round"]
        for row in map(json.loads, (run.run_dir / "metrics.jsonl").read_text().splitlines())
        if row["round"] > back + 1 and row["devices"].get(device, {}).get("status") == "accepted"
    ]
    if not rejoined:
        raise ScenarioFailed(f"{device} never had an update accepted after it came back")
    frozen = f"{device} frozen {deadline_s + 3:.0f} s (deadline {deadline_s:.0f} s)"
    return f"{frozen}, its rounds closed without it; back, it was accepted in round {rejoined[0]}"


def disk_full(run: FleetRun) -> str:
    run.run_dir.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(run.run_dir)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:
        raise NotRunnable(f"mounting a tmpfs needs root ({mounted.stderr.strip()})")
    try:
        coordinator = run.start_coordinator()
        run.mid_upload(2)
        filler = run.run_dir / "filler"
        fill(filler)
        code = run.finish(coordinator)
        if code != 1 or "no space left to write the run directory" not in run.err_file(0).read_text():
            raise ScenarioFailed(f"the coordinator exited with status {code} without the disk-full message")
        stopped_after = run.rounds_completed()
        filler.unlink()
        run.finish(run.start_coordinator())
    finally:
        run.stop_all()
        kept = run.root / "run-kept"
        shutil.copytree(run.run_dir, kept, ignore=shutil.ignore_patterns("filler"))
        subprocess.run(["umount", str(run.run_dir)], check=False)
        run.run_dir = kept
    return (
        f"run directory on a 64 MB tmpfs, filled mid-upload in round 2: the coordinator stopped cleanly "
        f"(status 1, one-line message) after round {stopped_after}; freed and resumed"
    )


class NotRunnable(Exception):
    """A scenario this host cannot stage (no root for a tmpfs)."""


def fill(path: Path) -> None:
    """Take every free byte of ``path``'s file system."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)


# name -> (title, rounds of its run given the repeats, the fault)
SCENARIOS: dict[str, tuple[str, Callable[[int], int], Callable[[FleetRun, int], str]]] = {
    "agent": ("kill -9 one agent mid-upload", lambda n: n, lambda run, n: kill_agents(run, n, half=False)),
    "half": ("kill -9 half the fleet mid-upload", lambda n: n, lambda run, n: kill_agents(run, n, half=True)),
    "coordinator": ("kill -9 the coordinator mid-upload", lambda n: n, kill_coordinator),
    "broker": ("kill -9 the broker mid-upload", lambda n: n, lambda run, n: kill_broker(run, n, wipe=False)),
    "offline": (
        "a device offline past the deadline rejoins",
        lambda _n: 4,
        lambda run, _n: offline_past_deadline(run, DEADLINE_S),
    ),
    "broker-wiped": (
        "broker restarted with persistence wiped",
        lambda _n: 2,
        lambda run, _n: kill_broker(run, 1, True),
    ),
    "disk-full": ("disk full in the run directory", lambda _n: 3, lambda run, _n: disk_full(run)),
}


def run_scenario(name: str, repeats: int, root: Path) -> Outcome:
    folder = root / name
    folder.mkdir()
    _title, rounds, fault = SCENARIOS[name]
    run = FleetRun(folder, rounds=rounds(repeats), deadline_s=DEADLINE_S)
    try:
        did = fault(run, repeats)
    except NotRunnable as exc:
        return Outcome(None, 0, 0, f"not run: {exc}")
    except (ScenarioFailed, OSError, psutil.Error, KeyError) as exc:
        run.stop_all()
        return Outcome(False, run.lost_updates(), run.rounds_completed(), f"{type(exc).__name__}: {exc}")
    finally:
        run.stop_all()
    return run.outcome(did)


def run_scenarios(names: list[str], repeats: int) -> dict[str, dict[str, object]]:
    """``{scenario title: Outcome as a dict}`` for each named scenario, each in a fresh folder."""
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    root = Path(tempfile.mkdtemp(prefix="fedfleet-faults-"))
    os.chmod(root, 0o711)  # the mosquitto user must reach the kits (as on a real broker host)
    results = {SCENARIOS[name][0]: asdict(run_scenario(name, repeats, root)) for name in names}
    if all(outcome["survived"] is not False for outcome in results.values()):  # None: not run here
        shutil.rmtree(root, ignore_errors=True)
    else:  # the agents', coordinators' and broker's logs say why
        print(f"faults: a scenario failed; its logs are kept in {root}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated (default: all: {','.join(SCENARIOS)})"
    )
    parser.add_argument("--repeats", type=int, default=3, help="faults per run for the kill scenarios (default: 3)")
    parser.add_argument(
        "--no-bad-inputs",
        dest="bad_inputs",
        action="store_false",
        help="skip benchmarks.bad_inputs (by default its kinds of hostile input are tried too, key bad_inputs)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--page", type=Path, help="rewrite the reliability tables on this page (docs/reliability.md)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    started = time.monotonic()
    try:
        scenarios = run_scenarios([s.strip() for s in args.scenarios.split(",") if s.strip()], args.repeats)
    except ValueError as exc:
        parser.error(str(exc))
    result: dict[str, object] = {"scenarios": scenarios, "repeats": args.repeats}
    if args.bad_inputs:
        result |= bad_inputs.run()
    result["seconds"] = round(time.monotonic() - started, 1)
    if args.page is not None:
        args.page.write_text(update_page(args.page.read_text(), result))
    if args.json:
        print(json.dumps(result))
    else:
        for title, row in scenarios.items():
            print(f"{title}: survived={row['survived']} lost={row['lost_updates']} ({row['detail']})")
        for kind, row in result.get("bad_inputs", {}).items():  # type: ignore[union-attr]
            print(f"{kind}: refused={row['refused']} reason={row['reason']} round_unaffected={row['round_unaffected']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
