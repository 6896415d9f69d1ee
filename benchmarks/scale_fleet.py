"""The scale benchmark's fleet: what the demo fleet becomes at N devices, and where its shards come from.

The bottom of the scale benchmark's three modules (emulation_scale runs fleets, flower_peer runs Flower on
scale_task's one-process task; all of them describe the fleet from here), so that none imports another in
a circle (a lint-imports contract in pyproject.toml keeps it so).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

_ROOT = Path(__file__).resolve().parents[1]
_DEMO = _ROOT / "examples" / "demo.yaml"
ROUNDS = 3


TRAIN_IMAGES = {"digits": 1437, "fashion_mnist": 60_000}


@dataclass(frozen=True)
class ScaleData:
    """Where the scale fleet's shards come from: a data set, at most ``samples`` training images per device
    (fleet.yaml's ``samples_per_device``; None: the set split evenly) and the images' side (None: the set's own).

    Why a cap and a smaller side: Fashion-MNIST's 60,000 at 28x28 split over 1,000 devices is 0.69 s of host
    compute per device-round on one thread, a 343 s compute floor on 2 cores, so no engine rounds it within a
    minute. ``recipe`` gives each set its scale default: Fashion-MNIST at 14x14, 8 images a device (a 38 s floor at
    1,000 devices), which keeps the accuracy after the rounds about learning on real images.
    """

    name: str = "digits"
    samples: int | None = None
    image_size: int | None = None

    @classmethod
    def recipe(cls, name: str, samples: int | None = None, image_size: int | None = None) -> ScaleData:
        """``name``'s scale default, ``samples`` (0: the set split evenly) and ``image_size`` replacing its values."""
        default = cls(name, 8, 14) if name == "fashion_mnist" else cls(name)
        return cls(
            name,
            default.samples if samples is None else samples or None,
            image_size or default.image_size,
        )

    def images_per_device(self, devices: int) -> int:
        share = TRAIN_IMAGES[self.name] // devices
        return share if self.samples is None else min(share, self.samples)

    def args(self) -> list[str]:
        """The flags that give another process (Flower's side of ``--peer flower``) this data."""
        flags = ["--dataset", self.name, "--samples-per-device", str(self.samples or 0)]
        return flags if self.image_size is None else [*flags, "--image-size", str(self.image_size)]


DIGITS = ScaleData()


def scale_fleet(
    devices: int,
    port: int,
    data: ScaleData = DIGITS,
    deadline_s: float | None = None,
    rounds: int = ROUNDS,
    strategy: str = "fedhm",
) -> dict:
    """The demo fleet with ``devices`` devices (its classes in turn, its overrides), iid data, 3 rounds;
    ``deadline_s`` replaces the demo's round deadline (a host that cannot train 60,000 images in it).

    ``strategy="fedavg"`` (the task ``--peer flower`` compares on): every device trains the full model, so
    the demo's ratios and the Pis' ``max_ratio`` caps go; the classes keep their compute, memory and links.
    """
    fleet = yaml.safe_load(_DEMO.read_text())
    if deadline_s is not None:
        fleet["round_deadline_s"] = deadline_s
    if data.name != "digits":
        fleet["dataset"]["name"] = data.name
        fleet["model"] |= {"in_channels": 1, "image_size": 28}
    if data.image_size is not None:
        fleet["model"]["image_size"] = data.image_size
    if data.samples is not None:
        fleet["dataset"]["samples_per_device"] = data.samples
    classes = [fleet["devices"][i] for i in (0, 3, 6)]  # orin, pi5 (max 1/2), pi4 (max 1/4)
    fleet["transport"]["broker"]["port"] = port
    fleet["rounds"] = rounds
    fleet["dataset"]["partition"] = "iid"  # dirichlet over hundreds of ~5-image shards leaves some empty
    if strategy != "fedhm":
        fleet["strategy"] = {"name": strategy}
        del fleet["ratios"]
        classes = [{k: v for k, v in device.items() if k != "overrides"} for device in classes]
    fleet["devices"] = []
    for index in range(devices):
        device = dict(classes[index % 3])
        device["id"] = f"{device['id'].split('-')[0]}-{index:04d}"
        fleet["devices"].append(device)
    return fleet
