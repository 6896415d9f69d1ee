import pytest

from benchmarks import fedlora
from benchmarks.fedlora import checks
from device_agent.data import datasets


def entry(accuracy: float, upload: float) -> dict:
    return {"accuracy": {"mean": accuracy, "std": 0.0}, "upload_bytes_per_round": upload}


def test_the_papers_two_claims_read_accuracy_and_upload_bytes() -> None:
    results = {
        "ft": entry(0.90, 1000.0),
        "lora_r2": entry(0.80, 50.0),  # 10x fewer bytes but 10 points behind
        "lora_r16": entry(0.885, 100.0),  # within 2 points with exactly 10x fewer bytes
        "fedlora": entry(0.82, 90.0),
    }
    assert checks(results) == {
        "lora_within_2_points_of_ft_with_10x_fewer_upload_bytes": True,
        "fedlora_at_least_homogeneous_lora_at_smallest_r": True,
    }
    results["lora_r16"] = entry(0.885, 101.0)
    results["fedlora"] = entry(0.79, 90.0)
    assert checks(results) == {
        "lora_within_2_points_of_ft_with_10x_fewer_upload_bytes": False,
        "fedlora_at_least_homogeneous_lora_at_smallest_r": False,
    }


def test_a_claim_whose_entries_did_not_run_is_left_out() -> None:
    assert checks({"ft": entry(0.9, 1000.0)}) == {}
    assert checks({"fedlora": entry(0.9, 10.0), "lora_r16": entry(0.9, 10.0)}) == {}


needs_fashion = pytest.mark.skipif(
    not datasets.FASHION_MNIST_DIR.is_dir(), reason="Debian's dataset-fashion-mnist is not installed"
)
TINY = fedlora.Bed(
    rounds=2, clients=6, participation=0.5, pretrain_epochs=1, source_samples=300, target_train=300, target_test=200
)
SETTING = f"fedlora/dirichlet-{TINY.dirichlet:g}"


@needs_fashion
def test_the_bed_pretrains_its_base_once_then_runs_every_cell_from_the_cache(tmp_path) -> None:
    lines: list[str] = []
    cache = tmp_path / "cells.jsonl"
    run = dict(seeds=1, strategies=["ft", "fedlora"], cache_file=cache, base_dir=tmp_path, log=lines.append)
    first = fedlora.report(TINY, **run)

    assert [p.name for p in tmp_path.glob("*.safetensors")] == [fedlora.base_file(TINY, tmp_path).name]
    assert set(first[SETTING]) == {"ft", "fedlora"}
    sweep = first["ft_lr_sweep"]  # tuned on a seed no cell is evaluated on
    assert set(sweep) == {"seed", *(f"{lr:g}" for lr in fedlora.FT_LRS)} and sweep["seed"] == fedlora.TUNING_SEED
    assert 0.0 <= first["probe_accuracy"] <= 1.0 and first["pixel_probe_accuracy"] > 0.5
    assert first["checks"]["base_transfers"] == (first["probe_accuracy"] >= fedlora.PROBE_BAR)
    ft, lora = (first[SETTING][e] for e in ("ft", "fedlora"))
    assert lora["upload_bytes_per_round"] < ft["upload_bytes_per_round"] / 10
    assert max(lora["trainable_params_per_device"]) < min(ft["trainable_params_per_device"]) / 10

    lines.clear()
    again = fedlora.report(TINY, **run)
    assert again[SETTING] == first[SETTING]
    assert any(line.endswith("(cached)") for line in lines)
    assert all("from the cache" in line for line in lines if "accuracy" in line and line.startswith("seed"))
