"""benchmarks.secagg: what it uploads under SecAgg and one small real run."""

import json

import pytest

from benchmarks import secagg


def test_fedhm_uploads_its_dense_update_masked_instead_of_its_factors():
    sizes = secagg.upload_sizes()
    assert sizes["fedavg"] == (94_634, 94_634)  # the CNN's float state: parameters and BatchNorm statistics
    factors, dense = sizes["fedhm"]
    assert dense == 94_634 and factors < dense / 3


def test_a_small_run_sums_within_the_bound_and_counts_every_exchange(capsys):
    assert secagg.main(["--json", "--devices", "5", "--dropout", "0,0.2", "--link-devices", ""]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["all_within_bound"] and len(report["rows"]) == 4
    fedavg, dropped = report["rows"][0], report["rows"][1]
    assert fedavg["neighbours"] == 4 and fedavg["survivors"] == 5 and dropped["survivors"] == 4
    # 19-bit ring words (16 bits + ceil(log2 5)) take 4 bytes like float32: the masked upload costs what the
    # plain one does, plus the protocol's keys and shares.
    assert fedavg["modulus_bits"] == 19
    assert 0 < fedavg["extra_bytes_per_device"] < 0.05 * fedavg["plain_bytes_per_device"]
    assert report["provenance"]["cpu"] and "commit" in report["provenance"]


@pytest.mark.slow
def test_rounds_over_the_memory_link_count_the_protocol_both_ways(capsys):
    assert secagg.main(["--json", "--devices", "3", "--dropout", "0", "--link-devices", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    fedavg, fedhm = report["link_rows"]
    assert report["link_all_accepted"] and fedavg["secure"]["secure"]["survivors"] == 5
    # FedAvg's masked upload is the size of its plain one: what is extra is the protocol's keys, shares and answers.
    assert 0 < fedavg["extra_bytes_per_device"] < 0.05 * fedavg["plain"]["bytes_per_device"]
    # FedHM's devices mask their dense update instead of uploading factors: the upload grows.
    assert fedhm["secure"]["bytes_up_per_device"] > 1.5 * fedhm["plain"]["bytes_up_per_device"]
    assert report["link_bytes_ratio_fedavg_5"] == fedavg["bytes_ratio"]
