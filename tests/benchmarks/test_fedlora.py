import pytest

from benchmarks import fedlora
from benchmarks.fedlora import checks
from benchmarks.stats import mean_std
from device_agent.data import datasets


def entry(seeds: list[float], upload: float) -> dict:
    return {"accuracy": mean_std(seeds), "upload_bytes_per_round": upload}


FT = [0.90, 0.80, 0.85, 0.88, 0.83]  # seeds spread by 0.1, as on the bed


def shifted(by: list[float]) -> list[float]:
    return [a + d for a, d in zip(FT, by, strict=True)]


def test_the_papers_two_claims_are_judged_on_paired_seed_intervals() -> None:
    results = {
        "ft": entry(FT, 1000.0),
        "lora_r2": entry(shifted([-0.10] * 5), 50.0),  # 10x fewer bytes but 10 points behind on every seed
        "lora_r16": entry(shifted([-0.011, -0.009, -0.010, -0.012, -0.008]), 100.0),  # 1 point behind, 10x fewer
        "fedlora": entry(shifted([-0.08, -0.09, -0.07, -0.08, -0.08]), 90.0),  # 2 points above lora_r2
    }
    found = checks(results)
    lean = found["lora_within_2_points_of_ft_with_10x_fewer_upload_bytes"]
    assert lean["verdict"] == "PASS" and lean["detail"].startswith("lora_r16 - ft = -0.010, 95% CI [")
    above = found["fedlora_at_least_homogeneous_lora_at_smallest_r"]
    assert above["verdict"] == "PASS" and above["difference"] == pytest.approx(0.02)

    results["lora_r16"] = entry(shifted([-0.011, -0.009, -0.010, -0.012, -0.008]), 101.0)  # not 10x fewer bytes
    results["fedlora"] = entry(shifted([-0.05, -0.15, -0.12, -0.06, -0.09]), 90.0)  # +0.01 on average, noisy
    found = checks(results)
    assert found["lora_within_2_points_of_ft_with_10x_fewer_upload_bytes"]["verdict"] == "FAIL"
    assert found["fedlora_at_least_homogeneous_lora_at_smallest_r"]["verdict"] == "TIE"


def test_a_rank_that_uploads_too_much_never_carries_the_within_2_points_claim() -> None:
    results = {"ft": entry(FT, 1000.0), "lora_r16": entry(FT, 500.0)}
    lean = checks(results)["lora_within_2_points_of_ft_with_10x_fewer_upload_bytes"]
    assert lean == {"verdict": "FAIL", "difference": None, "interval": None, "detail": lean["detail"]}
    assert "no LoRA rank uploads <= 1/10" in lean["detail"]


def test_one_seed_judges_nothing_and_its_json_has_no_infinite_interval() -> None:
    above = checks({"fedlora": entry([0.9], 10.0), "lora_r2": entry([0.5], 10.0)})
    claim = above["fedlora_at_least_homogeneous_lora_at_smallest_r"]
    assert (claim["verdict"], claim["interval"]) == ("TIE", None)
    assert claim["detail"] == "fedlora - lora_r2 = +0.400, one seed: no interval"


def test_a_claim_whose_entries_did_not_run_is_left_out() -> None:
    assert checks({"ft": entry(FT, 1000.0)}) == {}
    assert checks({"fedlora": entry(FT, 10.0), "lora_r16": entry(FT, 10.0)}) == {}


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
    assert sum(again["cells_by_commit"].values()) == len(fedlora.FT_LRS) + 2  # the sweep, ft and fedlora at seed 0
