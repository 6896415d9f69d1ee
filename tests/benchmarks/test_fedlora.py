from benchmarks.fedlora import checks


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
