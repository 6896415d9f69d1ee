"""A churn soak: a fleet whose devices leave and join at random for N minutes, with a broker crash
and a coordinator kill -9 on top. Does any update get lost, and does the coordinator's memory stay flat?

    python -m benchmarks.soak --minutes 20 --json
    python -m benchmarks.soak --minutes 1 --seed 7 --json   # the short version CI runs

It runs ``coordinator emulate`` (the real coordinator, its supervised mosquitto, one ``device-agent
run`` process per device) on a digits fleet of ten devices with the fault benchmark's helpers
(:class:`benchmarks.faults.FleetRun`): fast rounds (a short deadline, more rounds than any soak
closes) and ``--min-devices`` at half the fleet so rounds go on while devices are away. A seeded
churn driver stops a random agent (SIGTERM or SIGKILL) every half minute or so and restarts it,
as systemd would, after a random time away; at a third of the run the broker is killed -9 (its
supervisor restarts it), at two thirds the coordinator is killed -9 and resumed with the same
command (its agents die with it; the resume starts every device again). When the time is up the
coordinator is stopped (SIGTERM) and resumed once more with ``--rounds`` one past its last closed
round, so the round open at the stop closes too and every acknowledged update can be checked.

An update is *lost* when its agent logged the coordinator's receipt ``accepted`` (or ``duplicate``)
for a round whose metrics do not count it (:meth:`FleetRun.lost_updates`); one the peer check refused when
its round closed (``updates_refused_at_close``: the metrics say so and the run keeps it in quarantine) is
judged, not lost, and counted apart, as are the updates the update bound clipped (``updates_clipped``: every
device here is honest, so each is one the bound should have let through). The coordinator
process's memory (PSS, else RSS) is sampled every few seconds; each coordinator process's first
``warm-up`` seconds (imports, the dataset, the first rounds) are left out, and the growth is the
last samples' median over the first ones' after warm-up, across the kill and resume.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.faults import AGENT_EXIT_S, WAIT_S, FleetRun, ScenarioFailed
from benchmarks.output import print_result
from coordinator.run.metrics import RoundMetrics, failed_rounds
from coordinator.run.rundir import METRICS_FILE, read_metrics

DEVICES = tuple(f"orin-{i:02d}" for i in range(1, 6)) + tuple(f"pi5-{i:02d}" for i in range(1, 6))
DEADLINE_S = 15.0
ROUNDS = 100_000  # more than any soak closes: the soak ends the run itself
QUORUM = 0.5  # benchmarks.faults.FLEET's
SAMPLE_S = 5.0
WARMUP_S = 120.0  # per coordinator process, at most a quarter of the run
EDGE_SAMPLES = 5  # start and end are the medians of this many samples: one sample is noise


@dataclass
class Churn:
    """Devices leaving (their agent stopped) and joining (restarted) at seeded random times."""

    run: FleetRun
    rng: random.Random
    gap_s: float  # mean time between two departures
    max_away: int
    away: dict[str, float] = field(default_factory=dict)  # device -> when it comes back
    next_leave: float = 0.0
    counts: dict[str, int] = field(
        default_factory=lambda: {"leaves": 0, "joins": 0, "sigterm": 0, "sigkill": 0, "rejoined_by_resume": 0}
    )

    def schedule(self, now: float) -> None:
        self.next_leave = now + self.rng.uniform(0.5, 1.5) * self.gap_s

    def step(self, now: float) -> None:
        for device in [d for d, back in self.away.items() if back <= now]:
            self.run.restart_agent(device)
            del self.away[device]
            self.counts["joins"] += 1
        if now < self.next_leave:
            return
        self.schedule(now)
        if len(self.away) >= self.max_away:
            return
        pids = self.run.agent_pids()
        present = sorted(d for d in pids if d not in self.away)
        if not present:
            return
        device = self.rng.choice(present)
        how = self.rng.choice([signal.SIGTERM, signal.SIGKILL])
        try:
            agent = psutil.Process(pids[device])
            agent.send_signal(how)
            agent.wait(AGENT_EXIT_S)
        except psutil.NoSuchProcess:
            pass  # it ended on its own meanwhile: still away from now on
        self.counts["leaves"] += 1
        self.counts["sigterm" if how == signal.SIGTERM else "sigkill"] += 1
        self.away[device] = now + self.rng.uniform(0.5, 2.0) * self.gap_s

    def resumed(self) -> None:
        """The resumed coordinator started every device again: the ones away are back."""
        self.counts["rejoined_by_resume"] += len(self.away)
        self.away.clear()


@dataclass
class MemorySample:
    process: int  # which coordinator process: 0, then 1 after the kill
    age_s: float  # seconds since that process started
    mib: float


def coordinator_mib(pid: int) -> tuple[str, float]:
    """("pss", MiB) of one process, or ("rss", MiB) where PSS cannot be read."""
    process = psutil.Process(pid)
    try:
        return "pss", process.memory_full_info().pss / 2**20
    except (psutil.AccessDenied, AttributeError):
        return "rss", process.memory_info().rss / 2**20


def memory_summary(samples: list[MemorySample], warmup_s: float) -> tuple[dict[str, object], float | None]:
    """Start (median of the first samples after warm-up), end (of the last), max, per process and overall."""
    processes = []
    for number in sorted({s.process for s in samples}):
        warm = [s.mib for s in samples if s.process == number and s.age_s >= warmup_s]
        row: dict[str, object] = {"samples": len(warm)}
        if warm:
            start, end = statistics.median(warm[:EDGE_SAMPLES]), statistics.median(warm[-EDGE_SAMPLES:])
            row |= {"start": round(start, 1), "end": round(end, 1), "max": round(max(warm), 1)}
            row["growth"] = round(end / start - 1, 4)
        processes.append(row)
    measured = [p for p in processes if p["samples"]]
    if not measured:
        return {"warmup_s": warmup_s, "processes": processes}, None
    start, end = float(measured[0]["start"]), float(measured[-1]["end"])  # type: ignore[arg-type]
    top = max(float(p["max"]) for p in measured)  # type: ignore[arg-type]
    summary = {"warmup_s": warmup_s, "start": start, "end": end, "max": top, "processes": processes}
    return summary, round(end / start - 1, 4)


def clipped(rows: list[RoundMetrics]) -> dict[str, object]:
    """The accepted updates the update bound clipped, in all, by device, and the least share of an update kept:
    every device of the soak is honest, so each one clipped is a false positive of the bound."""
    shares = [(device, float(m.clipped)) for row in rows for device, m in row.devices.items() if m.clipped is not None]
    by_device: dict[str, int] = {}
    for device, _ in shares:
        by_device[device] = by_device.get(device, 0) + 1
    least = min((share for _, share in shares), default=None)
    return {"updates": len(shares), "by_device": dict(sorted(by_device.items())), "least_share_kept": least}


def stop_agents(run: FleetRun) -> None:
    """End the agents the churn restarted and wait until no agent of the run is left (no device runs twice).

    The coordinator's own agents end by themselves (its clean stop, or the parent-death signal when it is
    killed); the churn's are children of this process, so they get the same SIGTERM from here.
    """
    run.stop_restarted()
    deadline = time.monotonic() + AGENT_EXIT_S
    while left := run.agent_pids():  # not run.wait_for: that one gives up once the coordinator is gone, as here
        if time.monotonic() > deadline:
            raise ScenarioFailed(
                f"agents still ran {AGENT_EXIT_S:.0f} s after their coordinator stopped: {', '.join(sorted(left))}"
            )
        time.sleep(0.2)


def soak(minutes: float, seed: int, root: Path) -> dict[str, object]:
    total = minutes * 60
    warmup_s = min(WARMUP_S, total / 4)
    rng = random.Random(seed)
    min_devices = len(DEVICES) // 2
    run = FleetRun(root, ROUNDS, DEADLINE_S, devices=DEVICES, run_args=("--min-devices", str(min_devices)), name="soak")
    churn = Churn(run, rng, gap_s=min(30.0, max(8.0, total / 40)), max_away=len(DEVICES) // 3)
    samples: list[MemorySample] = []
    measure = "pss"
    broker_restarts = coordinator_kills = 0
    launched = time.monotonic()
    coordinator = run.start_coordinator()
    born = launched
    try:
        run.wait_for("round 1 to close", lambda: run.rounds_completed() >= 1)
        started = time.monotonic()  # the soak's minutes count from here: a loaded host may take a minute to start
        churn.schedule(started)
        last_sample = 0.0
        while (now := time.monotonic()) - started < total:
            if coordinator.poll() is not None:
                raise ScenarioFailed(f"the coordinator exited (status {coordinator.returncode}) mid-soak")
            if now - last_sample >= SAMPLE_S:
                measure, mib = coordinator_mib(coordinator.pid)
                samples.append(MemorySample(coordinator_kills, now - born, mib))
                last_sample = now
            churn.step(now)
            if not broker_restarts and now - started >= total / 3:
                pid = run.broker_pid()
                os.kill(pid, signal.SIGKILL)
                run.wait_for("the broker to be restarted", lambda p=pid: run.broker_restarted(p))
                broker_restarts += 1
            if not coordinator_kills and now - started >= 2 * total / 3:
                coordinator.kill()
                run.stop_restarted()  # at once: its own agents get SIGTERM from the kernel as it dies, these from us
                coordinator.wait()
                stop_agents(run)
                churn.resumed()
                coordinator, born = run.start_coordinator(), time.monotonic()
                coordinator_kills += 1
                churn.schedule(born)
            time.sleep(0.5)
        coordinator.terminate()  # a clean stop: the open round's accepted uploads stay in the journal
        run.finish(coordinator)
        stop_agents(run)
        closed = run.rounds_completed()
        code = run.finish(run.start_coordinator("--rounds", str(closed + 1)), timeout=WAIT_S * 2)
    finally:
        run.stop_all()
    soaked = time.monotonic() - launched
    rows = read_metrics(run.run_dir / METRICS_FILE)
    memory, growth = memory_summary(samples, warmup_s)
    problems = run.leftovers() + run.errors()
    return {
        "minutes": minutes,
        "seconds": round(soaked, 1),
        "seed": seed,
        "devices": len(DEVICES),
        "min_devices": min_devices,
        "round_deadline_s": DEADLINE_S,
        "rounds_closed": len({row.round for row in rows}),
        "updates_accepted": sum(d.status == "accepted" for row in rows for d in row.devices.values()),
        "updates_acknowledged": len(run.acknowledged()),
        "updates_lost": run.lost_updates(),
        "updates_refused_at_close": len(run.refused_at_close()),
        "updates_clipped": clipped(rows),
        "churn_events": churn.counts,
        "broker_restarts": broker_restarts,
        "coordinator_kills": coordinator_kills,
        "coordinator_memory_measure": measure,
        "coordinator_memory_mib": memory,
        "memory_growth_after_warmup": growth,
        "failed_rounds": failed_rounds(rows, QUORUM),
        "final_round": closed + 1,  # the round open at the stop, closed by the last resume
        "final_resume_status": code,
        "problems": problems,
        "coordinator_command": " ".join(
            ["python -m coordinator emulate --fleet FLEET --run-dir RUN --no-live --wait-timeout 60", *run.run_args]
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long the fleet churns (default: 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the churn's random draws (default: 0)")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (logs, run directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be positive")
    root = Path(tempfile.mkdtemp(prefix="fedfleet-soak-"))
    os.chmod(root, 0o711)  # the mosquitto user must reach the kits (as on a real broker host)
    argv = sys.argv[1:] if argv is None else argv
    try:
        result = {"command": " ".join(["python -m benchmarks.soak", *argv]), **soak(args.minutes, args.seed, root)}
    except (ScenarioFailed, OSError, psutil.Error, KeyError) as exc:
        print(f"soak: {type(exc).__name__}: {exc}; its logs are kept in {root}", file=sys.stderr)
        return 1
    kept = args.keep or result["updates_lost"] or result["updates_refused_at_close"]
    kept = kept or result["problems"] or result["failed_rounds"]
    if kept:
        print(f"soak: the run's folder is kept in {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
