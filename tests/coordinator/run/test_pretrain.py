"""``coordinator pretrain``: a base checkpoint, and the head-only linear probe that says whether it transfers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.cli.app import main
from coordinator.run.pretrain import augment_batch, class_subset, linear_probe, pretrain
from device_agent.data.datasets import LabeledData, load_dataset


def _tiny_target() -> LabeledData:
    """Digits 5-9, 40 training images per class: seconds on one core."""
    data = class_subset(load_dataset("digits", 8, 1), range(5, 10))
    keep = torch.cat([torch.nonzero(data.train_y == c).flatten()[:40] for c in range(5, 10)])
    return LabeledData(data.train_x[keep], data.train_y[keep], data.test_x, data.test_y, data.num_classes)


def test_the_probe_reads_the_frozen_base_and_is_deterministic() -> None:
    source = class_subset(load_dataset("digits", 8, 1), range(5))
    state = pretrain("vit_tiny", source.train_x, source.train_y, 10, epochs=3, seed=0)
    target = _tiny_target()

    probe = linear_probe("vit_tiny", state, target, seed=0)

    assert probe == linear_probe("vit_tiny", state, target, seed=0)
    assert 0.3 < probe <= 1.0  # 5 classes: chance is 0.2 (this 3-epoch digits base gives about 0.4)
    # It reads the base: with the final norm's scale zeroed every image has the same features, and the
    # probe can only guess the commonest class.
    blind = {**state, "norm.weight": torch.zeros_like(state["norm.weight"])}
    assert linear_probe("vit_tiny", blind, target, seed=0) < 0.3 < probe


def test_the_cli_prints_the_probe_accuracy_on_the_target_classes(tmp_path: Path, capsys) -> None:
    out = tmp_path / "base.safetensors"
    args = ["pretrain", "--arch", "vit_tiny", "--classes", "0-4", "--epochs", "1", "--probe-classes", "5-9"]

    assert main([*args, "--out", str(out)]) == 0

    printed = capsys.readouterr()
    assert out.is_file() and "test accuracy" in printed.out
    assert float(printed.out.split("probe_accuracy ")[1].split()[0]) > 0.2
    assert "epoch 1/1:" in printed.err and "samples/s" in printed.err


@pytest.mark.parametrize("flag", ["--classes", "--probe-classes"])
def test_classes_outside_the_data_set_are_named(tmp_path: Path, capsys, flag: str) -> None:
    argv = ["pretrain", "--arch", "vit_tiny", "--epochs", "1", flag, "8-12", "--out", str(tmp_path / "b.safetensors")]
    assert main(argv) == 2
    assert f"{flag} [10, 11, 12] not in 0-9" in capsys.readouterr().err


def test_augmentation_mirrors_and_shifts_each_batch_without_changing_its_shape() -> None:
    x = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 1, 4, 4)
    mirrored = augment_batch(x, shift=0)
    assert all(torch.equal(m, o) or torch.equal(m, o.flip(-1)) for m, o in zip(mirrored, x, strict=True))
    shifted = torch.stack([augment_batch(x, shift=1) for _ in range(20)])
    assert shifted.shape[1:] == x.shape and not all(torch.equal(s, shifted[0]) for s in shifted)


def test_anaugment_batch_pretraining_is_deterministic_for_a_seed() -> None:
    source = class_subset(load_dataset("digits", 8, 1), range(5))
    x, y = source.train_x[:200], source.train_y[:200]
    first, second = (pretrain("vit_tiny", x, y, 10, epochs=1, seed=3, augment=True) for _ in range(2))
    assert all(torch.equal(first[k], second[k]) for k in first)
