"""What ``coordinator start`` would refuse on this machine, found before it starts.

fleet.yaml's schema (:mod:`coordinator.config.fleet`) says whether the file makes sense anywhere; a fleet
can still be unable to start here: its data set has no path or the path is not on this machine,
a password's variable is unset (start reads every login), a managed TLS broker has no mosquitto to run. ``coordinator
validate`` and ``start`` ask the same questions, so a fleet that validates starts.
"""

from __future__ import annotations

from pathlib import Path

from coordinator.config.fleet import Fleet
from coordinator.run.fleet_data import no_server_data
from coordinator.transport.registry import transport_problems
from device_agent.data.datasets import BUILT_IN, DatasetError, check_source


def start_problems(fleet: Fleet) -> list[str]:
    """One line per reason ``start`` would fail here, each starting with the fleet.yaml key to fix."""
    return [*_data_problems(fleet), *transport_problems(fleet)]


def _data_problems(fleet: Fleet) -> list[str]:
    if no_server_data(fleet) is not None:
        return []
    dataset = fleet.dataset
    if dataset.name in BUILT_IN and dataset.path is None:
        try:
            check_source(dataset.name)
        except DatasetError as exc:
            return [f"dataset.name: {exc}"]
        return []
    if dataset.path is None:
        return [
            f"dataset.path: dataset {dataset.name!r} needs a path on the coordinator (its test split evaluates "
            "the global model); set dataset.path, or use name: digits or fashion_mnist (built in), or run without "
            "data: evaluation.server: false with model.in_channels and model.image_size"
        ]
    if not Path(dataset.path).exists():
        return [f"dataset.path: {dataset.path}: no such file or folder on this machine"]
    return []
