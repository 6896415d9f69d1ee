"""The coordinator's side of ``coordinator export``: a run directory, read, as export's ``TrainedRun``.

Export never imports the coordinator, so this module turns the run's fleet.yaml snapshot, saved
strategy state and strategy object into plain data and callables. It reads files only (no lock),
so a run can be exported while its coordinator is still going.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file

from coordinator.config.fleet import Fleet, parse_fleet
from coordinator.run.fleet_data import fleet_data
from coordinator.run.rundir import FLEET_FILE, RUN_FILE, STATE_DIR, RunDirError, read_run_file
from coordinator.strategies import ClientSlot, build_strategy
from export.targets import ExportError, TrainedRun


def open_trained_run(run_dir: Path, round_: int | None = None, data: Path | None = None) -> TrainedRun:
    """Round ``round_`` (default: the last completed) of the run in ``run_dir``; errors say what is missing.

    ``data`` replaces the data set's path of the run's fleet.yaml: a run copied to another machine, or
    one whose data moved, is exported against the same data set where it lies now.
    """
    run_dir = Path(run_dir)
    try:
        run = read_run_file(run_dir / RUN_FILE)
    except RunDirError as error:
        raise ExportError(str(error)) from None
    fleet = parse_fleet(yaml.safe_load((run_dir / FLEET_FILE).read_text()), None, str(run_dir / FLEET_FILE))
    fleet = _with_data(fleet, data)
    last = run["last_completed_round"]
    round_ = last if round_ is None else round_
    state_file = run_dir / STATE_DIR / f"round-{round_:06d}.safetensors"
    if not 0 <= round_ <= last or not state_file.is_file():
        saved = sorted(int(p.stem.removeprefix("round-")) for p in (run_dir / STATE_DIR).glob("round-*.safetensors"))
        raise ExportError(
            f"round {round_} has no saved state in {run_dir / STATE_DIR} "
            f"(last completed round: {last}; saved: {', '.join(map(str, saved)) or 'none'})"
        )
    try:
        state = load_file(str(state_file))
    except SafetensorError as error:
        raise ExportError(f"{state_file}: not a valid safetensors file ({error})") from None
    spec, _ = fleet_data(fleet)
    strategy = build_strategy(fleet.strategy.name, spec, fleet.strategy.params, seed=fleet.dataset.seed)
    strategy.load_state_dict(state)

    def assignment(device: str):
        sent = strategy.configure(round_ + 1, [ClientSlot(device, 1.0, 1)])[device]
        return sent.spec, sent.tensors

    return TrainedRun(
        path=run_dir,
        run_id=run["run_id"],
        round=round_,
        strategy=strategy.name,
        personalized=strategy.personalized,
        rank_levels=strategy.levels.factorized,
        ratios=tuple(fleet.ratios),
        arch=spec.arch,
        num_classes=spec.num_classes,
        in_channels=spec.in_channels,
        image_size=spec.image_size,
        dataset=fleet.dataset.name,
        dataset_path=fleet.dataset.path,
        global_model=strategy.global_model,
        personal_devices=tuple(d.id for d in fleet.devices if strategy.personalized_state(d.id) is not None),
        assignment=assignment,
    )


def _with_data(fleet: Fleet, data: Path | None) -> Fleet:
    """``fleet`` reading its data set from ``data``; a recorded path that is gone names the option that helps."""
    if data is not None:
        if not data.exists():
            raise ExportError(f"--data {data}: no such file or folder")
        return fleet.model_copy(update={"dataset": fleet.dataset.model_copy(update={"path": data})})
    path = fleet.dataset.path
    if path is not None and not path.exists():
        raise ExportError(
            f"the run's {fleet.dataset.name} data set is not at {path} on this machine: "
            "point export at a copy with --data PATH"
        )
    return fleet


def export_finished_run(fleet: Fleet, run_dir: Path) -> None:
    """The end-of-run exports fleet.yaml's ``export:`` section asks for; a failed one is logged, not fatal."""
    if fleet.export is None:
        return
    from export.auto import export_configured

    try:
        run = open_trained_run(run_dir)
    except ValueError as error:
        print(f"export: FAILED: {error}")
        return
    for line in export_configured(run, fleet.export):
        print(line)
