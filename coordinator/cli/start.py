"""``coordinator start``: run a fleet's rounds against a managed or external broker, resumable."""

from __future__ import annotations

import argparse
import logging
import math
import shlex
import signal
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from coordinator.cli.readiness import start_problems
from coordinator.config.fleet import Fleet, FleetError, load_fleet
from coordinator.observe import ObserveError, Watch, add_observe_arguments
from coordinator.provision import (
    Kits,
    ProvisionError,
    coordinator_tls,
    default_kits,
    lacks_tls,
    provision,
    read_credentials,
)
from coordinator.provision.broker_files import CONFIG
from coordinator.provision.builders import BUILDERS
from coordinator.rounds.async_engine import engine_class
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.rounds.signing import upload_signatures
from coordinator.run.fleet_data import fleet_data
from coordinator.run.metrics import RoundMetrics, failed_rounds
from coordinator.run.report import write_report
from coordinator.run.rundir import RunDir, RunDirError, latest_unfinished
from coordinator.run.storage import out_of_space_message
from coordinator.strategies import build_strategy
from coordinator.transport.allocator import keep_freed_buffers
from coordinator.transport.broker.base import BrokerError
from coordinator.transport.broker.credentials import Credentials
from coordinator.transport.broker.mosquitto import find_mosquitto
from coordinator.transport.broker.scratch import sweep_stale
from coordinator.transport.kinds.mqtt import BrokerServices
from coordinator.transport.registry import FleetSetup, transport_of
from device_agent.agent.config import ConfigError
from device_agent.data.datasets import DatasetError

log = logging.getLogger("fedfleet.coordinator")

RUNS = Path("runs")
"""Where runs go without --run-dir (relative to the working directory, as before)."""


_EPILOG = """\
examples:
  coordinator start --fleet examples/fleet.yaml                   resume its newest unfinished run, else a new one
  coordinator start --fleet fleet.yaml --run-dir runs/lab         resume runs/lab if it exists
  coordinator start --fleet fleet.yaml --min-devices 2 --rounds 5

Broker logins, the CA and certificates belong to the fleet, not to a run: they are read from the
fleet's kits (--kits, default kits/<fleet>/ next to fleet.yaml; `coordinator provision` writes them,
and a first start provisions them if they are missing), so a new run never changes a device's secret.
A managed broker runs kits/broker/mosquitto.conf and stops with the coordinator. Ctrl-C stops cleanly and
prints the command that resumes the run (with its --run-dir), including the updates accepted in the open round.
Without --run-dir the fleet's newest run in runs/ is resumed if it is unfinished (--new-run starts another).
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    start = commands.add_parser(
        "start",
        help="run the fleet's federated rounds (broker, devices, rounds, checkpoints, report)",
        description=(
            "Start (or connect to) the fleet's MQTT broker, wait for enough devices, then run rounds: "
            "plan each device's rank ratio, push its payload, fold the updates as they arrive, evaluate "
            "the global model on held-out data and checkpoint the run directory after every round."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(start, min_devices_default="quorum x fleet size", wait_timeout=600.0)
    start.set_defaults(handler=run_start)


def add_run_arguments(parser: argparse.ArgumentParser, min_devices_default: str, wait_timeout: float) -> None:
    """The options of a run, shared by ``start`` and ``emulate`` (which is ``start`` plus agents)."""
    parser.add_argument("--fleet", type=Path, required=True, metavar="FILE", help="fleet.yaml")
    parser.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="new or existing run directory to resume (default: the fleet's newest run in runs/ if it is "
        "unfinished, else a new runs/<fleet>-<time>)",
    )
    parser.add_argument(
        "--new-run", action="store_true", help="start a new run even when the fleet's newest run is unfinished"
    )
    parser.add_argument(
        "--kits", type=Path, metavar="DIR", help="the fleet's provisioned kits (see `coordinator provision`)"
    )
    parser.add_argument("--rounds", type=int, metavar="N", help="override fleet.yaml's rounds")
    parser.add_argument(
        "--min-devices", type=int, metavar="N", help=f"devices online before round 1 (default: {min_devices_default})"
    )
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=wait_timeout,
        metavar="S",
        help=f"give up waiting for devices after S s (default: {wait_timeout:g})",
    )
    parser.add_argument("--no-live", action="store_true", help="log lines instead of the live table")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_observe_arguments(parser)


ON_THIS_HOST = tuple(builder for builder in BUILDERS if builder.name != "bundles")
"""What ``coordinator emulate`` provisions: every kit but its ``<device>.tar.gz``, which emulated devices never
unpack (they read their kit folders); gzipping each kit's agent wheel was 3.3 of 7 CPU-s at 300 devices."""


def fleet_kits(fleet: Fleet, kits_dir: Path, emulated: bool = False) -> tuple[Kits, dict[str, Credentials]]:
    """The fleet's kits and every login in them; a fleet never provisioned is provisioned now (quietly).

    Kits provisioned without TLS for a fleet whose managed broker has it (the amqtt fallback's, before
    mosquitto was installed) are provisioned again with TLS when ``emulated`` (every device is on this host),
    saying so; for real devices, which would need their new kits, it is refused with the command to run.
    ``emulated`` kits are provisioned without device bundles (:data:`ON_THIS_HOST`).
    """
    kits = Kits(kits_dir)
    upgrade = lacks_tls(fleet, kits)
    if upgrade and not emulated:
        raise ProvisionError(
            f"the kits in {kits_dir} were provisioned without TLS, but this fleet's broker has TLS: provision them "
            f"again (coordinator provision --fleet FLEET --out {kits_dir}, with the options they were provisioned "
            "with), then give every device its new kit"
        )
    if upgrade or not (kits_dir / "fleet.json").exists():
        done = provision(fleet, kits_dir, builders=ON_THIS_HOST if emulated else BUILDERS)
        if upgrade:
            print(
                f"the kits in {kits_dir} were provisioned without TLS (for the amqtt fallback, before mosquitto was "
                f"installed?) but this fleet's broker has TLS: provisioned them again with TLS, same passwords; the "
                f"emulated devices now dial {done.broker_url}"
            )
        elif emulated:
            print(
                f"provisioned the fleet's kits in {kits_dir} for this host's emulated devices (no device bundles: "
                f"coordinator provision --fleet FLEET --out {kits_dir} writes {kits_dir}/<device>.tar.gz)"
            )
        else:
            print(f"provisioned the fleet's kits in {kits_dir} (device kits: {kits_dir}/<device>.tar.gz)")
        if done.missing:
            raise ProvisionError("; ".join(done.missing.values()))
    return kits, read_credentials(fleet, kits)


EXIT_PRIVACY_BUDGET = 3
"""``coordinator start`` / ``emulate`` stopped before a round that would have passed fleet.yaml's privacy budget."""

PLAIN_FALLBACK_WARNING = (
    "WARNING: mosquitto is not installed, so this emulation runs on the amqtt development broker "
    "WITHOUT TLS (plain MQTT 3.1.1 on {host}:{port}). Fine for a demo on one host; a real fleet needs "
    "`apt install mosquitto` (`coordinator start` refuses to run a TLS fleet without it)."
)


def _without_mosquitto(fleet: Fleet) -> Fleet:
    """The fleet on the plain amqtt broker when it asks for a managed TLS broker and mosquitto is missing."""
    broker = fleet.broker
    if broker.mode != "managed" or not broker.tls or find_mosquitto() is not None:
        return fleet
    port = broker.port if broker.port != 8883 else 1883
    plain = broker.model_copy(update={"mode": "amqtt", "tls": False, "port": port})
    banner = PLAIN_FALLBACK_WARNING.format(host=broker.host, port=port)
    print(f"\n{'!' * 100}\n{banner}\n{'!' * 100}\n", file=sys.stderr, flush=True)
    log.warning(banner)
    return fleet.with_broker(plain)


def run_start(
    args: argparse.Namespace,
    on_broker_ready: Callable[[str, dict[str, Credentials], Path, str], Callable[[], object]] | None = None,
    plain_fallback: bool = False,
) -> int:
    """``coordinator start``. ``on_broker_ready(url, credentials, run_dir, protocol)`` runs once the broker is
    up and returns what to run before it stops (``coordinator emulate`` starts and stops its agents there);
    ``protocol`` is the MQTT version the broker speaks ("3.1.1" for the amqtt fallback).

    ``plain_fallback`` (emulation, where every process is on this host): a managed TLS broker without
    mosquitto installed becomes the plain amqtt development broker, loudly, instead of a refusal."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_freed_buffers()  # this process ingests every upload: reuse freed buffers (see coordinator.transport.allocator)
    try:
        fleet, catalog = load_fleet(args.fleet)
        if plain_fallback:
            fleet = _without_mosquitto(fleet)
        problems = start_problems(fleet)
        if problems:
            raise FleetError(f"{args.fleet} cannot start here:\n" + "\n".join(problems))
        if args.rounds is not None:
            fleet = fleet.model_copy(update={"rounds": args.rounds})
        spec, data = fleet_data(fleet)
        strategy = build_strategy(fleet.strategy.name, spec, fleet.strategy.params, seed=fleet.dataset.seed)
        run_dir = args.run_dir or _default_run_dir(fleet, new=args.new_run)
        sweep_stale()
        if (run_dir / "run.json").exists():
            rundir = RunDir.open(run_dir, args.fleet, retention=fleet.checkpoints)
            if rundir.last_completed_round >= fleet.rounds:
                rundir.close()
                print(f"{run_dir} is complete: all {fleet.rounds} rounds are done (--rounds N runs more)")
                return 0
            print(f"resuming {run_dir} after round {rundir.last_completed_round}")
        else:
            state = strategy.state_dict()
            rundir = RunDir.create(run_dir, args.fleet, state, seed=fleet.dataset.seed, retention=fleet.checkpoints)
            print(f"new run {rundir.run_id} in {run_dir}")
        kits, credentials = fleet_kits(fleet, args.kits or default_kits(args.fleet, fleet), emulated=plain_fallback)
        signatures = upload_signatures(fleet, kits)
        tls = coordinator_tls(kits) if fleet.broker.tls else {}
        setup = FleetSetup(fleet, run_dir, credentials, tls, kits.broker / CONFIG, plain_fallback)
        services = transport_of(fleet).services(setup)
        if on_broker_ready is not None and not isinstance(services, BrokerServices):
            raise FleetError(f"transport.kind: {fleet.transport.kind}: emulation runs its agents on a broker (mqtt)")
        watch = Watch(args, rundir.metrics)
    except (FleetError, RunDirError, DatasetError, ConfigError, BrokerError, ObserveError, ValueError) as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"coordinator: error: {out_of_space_message(exc, args.run_dir or Path('runs'))}", file=sys.stderr)
        return 1
    before_broker_stops: Callable[[], object] | None = None
    engine: RoundEngine | None = None
    try:
        try:
            services.start()
        except (BrokerError, ConnectionError) as exc:
            print(f"coordinator: error: {exc}", file=sys.stderr)
            return 1
        print(services.describe())
        if isinstance(services, BrokerServices) and services.address is not None and on_broker_ready is not None:
            before_broker_stops = on_broker_ready(services.address.url, credentials, run_dir, services.protocol)
        min_devices = args.min_devices or max(1, math.ceil(fleet.quorum * len(fleet.devices)))
        engine = engine_class(fleet)(
            fleet,
            catalog,
            strategy,
            rundir,
            data,
            services.link(),
            EngineSettings.of(fleet, min_devices, args.wait_timeout),
            signatures=signatures,
        )
        signal.signal(signal.SIGTERM, lambda *_: engine.stop())
        services.on_give_up(lambda _why: engine.stop())
        finished = _run(engine, live=not args.no_live and sys.stdout.isatty(), watch=watch)
    except KeyboardInterrupt:
        finished = False
    except TimeoutError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"coordinator: error: {out_of_space_message(exc, run_dir)}", file=sys.stderr)
        return 1
    finally:
        watch.stop()
        if before_broker_stops is not None:
            before_broker_stops()
        services.stop()
        rundir.close()
    if services.failure:
        print(f"coordinator: error: {services.failure}; resume with: {resume_command(args, run_dir)}", file=sys.stderr)
        return 1
    if finished:
        from coordinator.run.exporting import export_finished_run

        export_finished_run(fleet, run_dir)
    if rundir.metrics():
        print(f"report: {write_report(run_dir)}")
    if not finished and engine is not None and engine.budget_exhausted is not None:
        print(f"coordinator: stopped: {engine.budget_exhausted}", file=sys.stderr)
        return EXIT_PRIVACY_BUDGET
    if not finished:
        print(f"stopped; resume with: {resume_command(args, run_dir)}")
        return 0
    return finished_run_status(rundir.metrics(), fleet.quorum)


def _default_run_dir(fleet: Fleet, new: bool) -> Path:
    unfinished = None if new else latest_unfinished(RUNS, fleet.fleet, fleet.rounds)
    if unfinished is not None:
        print(f"the fleet's newest run {unfinished} is unfinished: resuming it (--new-run starts another)")
        return unfinished
    return RUNS / f"{fleet.fleet}-{datetime.now():%Y%m%d-%H%M%S}"


def resume_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The command the user gave (its --kits, --rounds and the rest), pinned to ``run_dir`` and never --new-run."""
    words = [word for word in args.argv if word != "--new-run"]
    if args.run_dir is None:
        words += ["--run-dir", str(run_dir)]
    return "coordinator " + shlex.join(words)


def finished_run_status(rounds: list[RoundMetrics], quorum: float) -> int:
    """0 when every round aggregated its quorum; else say which rounds failed and return 1."""
    failed = failed_rounds(rounds, quorum)
    if not failed:
        print("all rounds done")
        return 0
    listed = ", ".join(map(str, failed[:20])) + (f" and {len(failed) - 20} more" if len(failed) > 20 else "")
    print(
        f"coordinator: {len(failed)} of {len(rounds)} rounds failed (no update, or accepted updates from fewer "
        f"than the quorum, {quorum:.0%} of the devices asked): round {listed}; "
        "see the refusals and failures in the log",
        file=sys.stderr,
    )
    return 1


def _run(engine: RoundEngine, live: bool, watch: Watch) -> bool:
    """Run with Ctrl-C as a clean stop: the open round's accepted updates stay journaled."""
    previous = signal.signal(signal.SIGINT, lambda *_: engine.stop())
    try:
        if not live:
            return engine.run(watch.update)
        from rich.live import Live

        from coordinator.cli.live import round_table

        with Live(round_table(engine), refresh_per_second=2, transient=False) as view:

            def show(e: RoundEngine) -> None:
                view.update(round_table(e))
                watch.update(e)

            return engine.run(show)
    finally:
        signal.signal(signal.SIGINT, previous)
