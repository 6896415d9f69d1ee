"""benchmarks.compare runs every strategy through the round engine, not a loop of its own."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from benchmarks import compare
from benchmarks.machine import source
from benchmarks.stats import mean_std
from coordinator.config.limits import GateSettings
from coordinator.rounds.engine import RoundEngine
from coordinator.strategies import STRATEGIES
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from device_agent.layers.hybrid import hybrid
from device_agent.models import build_model


@pytest.mark.slow
def test_a_setting_runs_through_the_round_engine(monkeypatch) -> None:
    runs: list[str] = []
    original = RoundEngine.run

    def spy(self, *args, **kwargs):
        runs.append(self.strategy.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RoundEngine, "run", spy)
    data = load_dataset("digits", 8, 1)
    setting = compare.scenarios(4, seed=0)["hetero-devices"][0]
    row = compare.run_setting("fedhm", setting, data, rounds=1, train=TrainConfig(batch_size=32))
    assert runs == ["fedhm"]
    assert 0 < row["accuracy"] <= 1 and 0 < row["personalized_accuracy"] <= 1
    assert row["upload_bytes_per_round"] > 0


@pytest.mark.slow
def test_device_tiers_follow_what_the_strategy_level_means() -> None:
    data = load_dataset("digits", 8, 1)
    ranks = compare.levels_for(STRATEGIES["fedhm"].levels, 4, tiered=True, data=data)
    widths = compare.levels_for(STRATEGIES["heterofl"].levels, 4, tiered=True, data=data)
    assert ranks == [1.0, 0.5, 0.25, 0.125]
    assert widths[0] <= 1 and widths == sorted(widths, reverse=True) and widths[1:] != ranks[1:]
    assert compare.levels_for(STRATEGIES["factorized_fl"].levels, 4, tiered=True, data=data) == [1.0] * 4
    assert compare.levels_for(STRATEGIES["fedhm"].levels, 4, tiered=False, data=data) == [1.0] * 4


def test_all_scenarios_skip_the_fine_tuning_strategies_with_a_note(monkeypatch, capsys) -> None:
    ran: set[str] = set()

    def run_setting(name, setting, data, rounds, train, arch="cnn", limits=None) -> dict:
        ran.add(name)
        return {"accuracy": 0.5, "personalized_accuracy": 0.5, "upload_bytes_per_round": 1.0, "seconds": 0.0} | {
            "failed_rounds": 0
        }

    monkeypatch.setattr(compare, "run_setting", run_setting)
    assert compare.main(["--scenario", "all", "--rounds", "1", "--seeds", "1", "--json"]) == 0

    fine_tuning = {"ft", "lora_homogeneous", "fedlora", "hetlora", "flora"}
    assert ran == set(STRATEGIES) - fine_tuning | {"simfed_paper"}  # SimFed at its paper's settings too
    out = capsys.readouterr()
    assert set(json.loads(out.out)["domains/2-domains"]) == ran
    assert json.loads(out.out)["screening"] is False and json.loads(out.out)["limits"] == compare.screening.OFF
    note, *progress = out.err.splitlines()  # then one progress line per cell
    settings = sum(len(found) for found in compare.scenarios(8, seed=0).values())
    assert len(progress) == len(ran) * settings and all(line.startswith("[") for line in progress)
    skipped, why = note.split(": ", 1)
    assert set(skipped.removeprefix("skipped ").split(", ")) == fine_tuning
    assert why.startswith("fine-tuning strategies start from a pre-trained")


@pytest.mark.parametrize(("dataset", "arch"), [("digits", "cnn"), ("fashion_mnist", "cnn28")])
def test_each_dataset_trains_its_own_cnn_unless_arch_is_given(monkeypatch, capsys, dataset, arch) -> None:
    archs: list[str] = []

    def run_setting(name, setting, data, rounds, train, arch="cnn", limits=None) -> dict:
        archs.append(arch)
        return {"accuracy": 0.5, "personalized_accuracy": 0.5, "upload_bytes_per_round": 1.0, "seconds": 0.0} | {
            "failed_rounds": 0
        }

    monkeypatch.setattr(compare, "run_setting", run_setting)
    monkeypatch.setattr(compare, "load_data", lambda *_args: load_dataset("digits", 8, 1))
    cell = ["--scenario", "domains", "--strategies", "fedavg", "--rounds", "1", "--seeds", "1", "--json"]
    cell += ["--dataset", dataset]
    assert compare.main(cell) == 0
    assert compare.main([*cell, "--arch", "resnet9"]) == 0

    assert archs == [arch, "resnet9"]
    first = capsys.readouterr().out.split("\n}\n")[0] + "\n}"
    assert json.loads(first)["arch"] == arch


def test_asking_for_a_fine_tuning_strategy_outside_its_scenario_is_refused(capsys) -> None:
    assert compare.main(["--scenario", "domains", "--strategies", "fedavg,fedlora"]) == 2
    assert "--strategies fedlora: fine-tuning strategies start from a pre-trained ViT" in capsys.readouterr().err


def test_participation_sets_how_many_fedlora_clients_a_round_asks(monkeypatch, capsys) -> None:
    beds = []
    report = {"bed": {}, "probe_accuracy": 0.9, "pixel_probe_accuracy": 0.9, "checks": {}}
    monkeypatch.setattr(compare.fedlora, "report", lambda bed, *args: beds.append(bed) or report)
    assert compare.main(["--scenario", "fedlora", "--participation", "0.3", "--json"]) == 0
    assert beds[0].participation == 0.3 and beds[0].clients == compare.fedlora.Bed().clients
    assert json.loads(capsys.readouterr().out)["provenance"]["commit"] == source()["commit"]  # what it ran at
    assert compare.main(["--scenario", "domains", "--participation", "0.3"]) == 2
    assert "--participation is the fedlora scenario's" in capsys.readouterr().err
    assert compare.main(["--scenario", "fedlora", "--participation", "1.5"]) == 2
    assert "--participation must be in (0, 1]" in capsys.readouterr().err


def _row(accuracy: list[float], personalized: list[float], upload: float) -> dict:
    return {
        "accuracy": mean_std(accuracy),
        "personalized_accuracy": mean_std(personalized),
        "upload_bytes_per_round": upload,
    }


def test_claims_are_judged_on_paired_seed_differences_with_a_confidence_interval() -> None:
    seeds = [0.70, 0.60, 0.80, 0.65, 0.75]  # seeds spread by 0.2, as on Fashion-MNIST
    results = {
        "hetero-devices/dirichlet-0.5": {
            "fedhm": _row([a + 0.02 for a in seeds], seeds, 100),  # 2 points better on every seed
            "heterofl": _row(seeds, seeds, 100),
            "fedrolex": _row([a + d for a, d in zip(seeds, (0.03, -0.04, 0.02, -0.01, 0.0), strict=True)], seeds, 100),
        },
        "permuted-labels/iid": {
            "fedavg": _row(seeds, [0.1] * 5, 1000),
            "factorized_fl": _row(seeds, [0.7, 0.72, 0.71, 0.69, 0.7], 200),
            "simfed": _row(seeds, [0.09, 0.08, 0.09, 0.07, 0.09], 1000),
        },
    }
    checks = compare.claims(results)
    lines = compare.claim_lines(checks).splitlines()
    # A mean + 1 std rule would call all of these but the last ties passes; the paired interval separates them.
    assert lines[0].startswith("PASS hetero-devices/dirichlet-0.5: FedHM >= HeteroFL, global")
    assert lines[1].startswith("TIE hetero-devices/dirichlet-0.5: FedHM >= FedRolex, global")
    assert lines[2].startswith("FAIL permuted-labels/iid: Factorized-FL >= FedAvg, personalized with <= 1/10")
    assert lines[2].endswith("upload ratio 0.200)")
    assert lines[3].startswith("FAIL permuted-labels/iid: SimFed (fedfleet's defaults) >= FedAvg, personalized")
    assert len(lines) == 4
    first = checks[0]
    assert first["difference"] == pytest.approx(0.02) and first["interval"][0] > 0
    assert "95% CI" in first["detail"] and "over 5 seeds" in first["detail"]


def test_fashion_mnist_without_the_package_names_it(monkeypatch, capsys, tmp_path) -> None:
    from device_agent.data import datasets

    monkeypatch.setattr(datasets, "FASHION_MNIST_DIR", tmp_path / "absent")
    assert compare.main(["--scenario", "domains", "--dataset", "fashion_mnist", "--strategies", "fedavg"]) == 2
    assert "apt-get install dataset-fashion-mnist" in capsys.readouterr().err


def test_a_split_that_leaves_a_client_empty_says_so() -> None:
    data = load_dataset("digits", 8, 1)
    tiny = compare.LabeledData(data.train_x[:10], data.train_y[:10], data.test_x, data.test_y, 10)
    setting = compare.scenarios(8, seed=1)["hetero-devices"][1]
    with pytest.raises(ValueError, match=r"dirichlet-0.1 \(seed 1\) leaves client-\d+.* without training data"):
        compare.run_setting("fedavg", setting, tiny, rounds=1, train=TrainConfig(batch_size=32))


@pytest.mark.slow
def test_cells_run_in_worker_processes_give_the_same_results() -> None:
    load = partial(compare.load_data, "digits", 1, 1)
    data, train = load(), TrainConfig(batch_size=32)
    args = (["domains"], 1, 1, 4, train, ["fedavg", "fedhm"], data)
    torch.set_num_threads(1)  # as main() and every worker do
    alone = compare.compare(*args)
    pooled = compare.compare(*args, jobs=2, load=load)
    assert pooled == {
        setting: {name: row | {"wall_seconds": pooled[setting][name]["wall_seconds"]} for name, row in rows.items()}
        for setting, rows in alone.items()
    }
    assert set(pooled) == {"domains/2-domains"} and set(pooled["domains/2-domains"]) == {"fedavg", "fedhm"}


@pytest.mark.parametrize("arch", ["cnn", "cnn28"])
def test_a_matched_width_never_has_fewer_parameters_than_fedhm_at_its_ratio(arch: str) -> None:
    for gamma in compare.RANKS:
        width = compare.matched_width(gamma, 10, 1, arch)
        with torch.device("meta"):
            fedhm = compare.trainable_params(hybrid(arch, gamma, 10, 1))
            dense = compare.trainable_params(build_model(arch, 10, 1, width=width))
        assert fedhm <= dense <= 1.05 * fedhm or width == 1.0, (gamma, width, fedhm, dense)


@pytest.mark.slow
@pytest.mark.parametrize("screening", [False, True])
def test_compare_runs_the_strategies_with_the_gates_screening_off_unless_asked(monkeypatch, screening) -> None:
    """Honest non-IID updates were clipped and refused under fleet.yaml's defaults: compare measured the gate."""
    gates = []
    original = RoundEngine.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        gates.append(self.settings.gate)

    monkeypatch.setattr(RoundEngine, "__init__", spy)
    data = load_dataset("digits", 8, 1)
    setting = compare.scenarios(4, seed=0)["hetero-devices"][1]  # Dirichlet 0.1
    limits = compare.screening.limits(screening)
    row = compare.run_setting("fedavg", setting, data, rounds=1, train=TrainConfig(batch_size=32), limits=limits)
    [gate] = gates
    if screening:
        assert gate == GateSettings()  # fleet.yaml's defaults, whatever they are
    else:
        assert gate.update_bound_factor is None and gate.peer_min_cosine is None and gate.peer_hard_floor is None
        assert row["failed_rounds"] == 0
    assert gate.max_norm_ratio == 10.0  # the bound on absurd values stays either way
