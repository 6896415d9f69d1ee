"""A small real run directory, made in-process: one FL round of a strategy on digits, saved as
the coordinator saves it (RunDir state + metrics, emulated agents' kept state)."""

from __future__ import annotations

from pathlib import Path

import yaml

from coordinator.config.fleet import load_fleet
from coordinator.rounds.evaluation import calibrate_batchnorm
from coordinator.run.fleet_data import fleet_data
from coordinator.run.metrics import RoundMetrics
from coordinator.run.rundir import RunDir
from coordinator.strategies import ClientSlot, build_strategy
from device_agent.agent.kept import KeptStore
from device_agent.clients import build_program
from device_agent.training.optimizer import TrainConfig, train_local
from export.targets import AGENT_KEPT_DIR

DEVICES = ("dev-a", "dev-b")


def make_run(
    root: Path,
    arch: str = "cnn",
    strategy: str = "fedhm",
    image_size: int | None = None,
    in_channels: int | None = None,
    ratios: tuple[str, ...] = ("1", "1/2", "1/4"),
    samples: int = 32,
    export: dict | None = None,
    dataset: str = "digits",
    dataset_path: Path | None = None,
) -> Path:
    """Train one round (each device a few steps on its own digits) and save it as RUN_DIR; returns it."""
    model = {"arch": arch, "num_classes": 10}
    model.update({k: v for k, v in (("image_size", image_size), ("in_channels", in_channels)) if v is not None})
    config = {
        "fleet": "t",
        "transport": {"broker": {"mode": "managed"}},
        "model": model,
        "dataset": {"name": dataset}
        if dataset_path is None
        else {"name": dataset, "path": str(dataset_path), "samples_per_device": samples},
        "strategy": {"name": strategy},
        "ratios": list(ratios),
        "rounds": 1,
        "devices": [{"id": d, "profile": "jetson-orin-nano-8gb"} for d in DEVICES],
    }
    if export is not None:
        config["export"] = export
    root.mkdir(parents=True, exist_ok=True)
    fleet_file = root / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(config))
    fleet, _ = load_fleet(fleet_file)
    spec, data = fleet_data(fleet)
    fl = build_strategy(fleet.strategy.name, spec, fleet.strategy.params, seed=0)
    run_dir = root / "run"
    rundir = RunDir.create(run_dir, fleet_file, fl.state_dict(), seed=0)
    levels = [min(fleet.ratios), 1.0] if fl.levels.factorized else [1.0, 1.0]
    slots = [ClientSlot(d, level, samples) for d, level in zip(DEVICES, levels, strict=True)]
    assignments = fl.configure(1, slots)
    aggregate = fl.open_round(1, slots)
    for index, slot in enumerate(slots):
        program = build_program(assignments[slot.client_id].spec, assignments[slot.client_id].tensors)
        part = slice(index * samples, (index + 1) * samples)
        train_local(program, (data.train_x[part], data.train_y[part]), TrainConfig(batch_size=16, seed=index))
        aggregate.add(slot.client_id, program.upload(), samples, program.extras())
        KeptStore(run_dir / AGENT_KEPT_DIR.format(device=slot.client_id)).save(rundir.run_id, program.keep())
    fl.close_round(aggregate)
    fl.load_norm_statistics(calibrate_batchnorm(fl.global_model(), data.train_x[:64]))
    metrics = RoundMetrics(round=1, accuracy=0.5, loss=1.0, participants=2, bytes_up=0, bytes_down=0, seconds=1.0)
    rundir.complete_round(1, fl.state_dict(), metrics)
    rundir.close()
    return run_dir
