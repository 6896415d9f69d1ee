import json

import pytest

from benchmarks import compare
from benchmarks.cell_cache import CacheMismatch, CellCache

CONFIG = {"dataset": "digits", "rounds": 10, "train": {"lr": 0.05}}


def test_cells_survive_a_reopen_and_a_line_cut_short_by_a_kill_is_dropped(tmp_path) -> None:
    path = tmp_path / "cells.jsonl"
    cache = CellCache(path, CONFIG)
    cache.put("domains/2-domains/seed 0/fedavg", {"accuracy": 0.5})
    with path.open("a") as out:
        out.write('{"cell": "domains/2-domains/seed 0/fedhm", "row": {"accur')  # killed mid-write

    again = CellCache(path, CONFIG)
    again.put("domains/2-domains/seed 1/fedavg", {"accuracy": 0.6})

    assert again.get("domains/2-domains/seed 0/fedavg") == {"accuracy": 0.5}
    assert again.get("domains/2-domains/seed 0/fedhm") is None
    assert [json.loads(line) for line in path.read_text().splitlines()][1:] == [
        {"cell": "domains/2-domains/seed 0/fedavg", "row": {"accuracy": 0.5}, "source": "unknown"},
        {"cell": "domains/2-domains/seed 1/fedavg", "row": {"accuracy": 0.6}, "source": "unknown"},
    ]


def test_cells_of_another_configuration_are_refused_naming_what_differs(tmp_path) -> None:
    path = tmp_path / "cells.jsonl"
    CellCache(path, CONFIG).put("a", {"accuracy": 0.5})

    with pytest.raises(CacheMismatch, match=r"differs in: rounds, train\)"):
        CellCache(path, CONFIG | {"rounds": 5, "train": {"lr": 0.1}})


def test_cells_of_another_commit_are_refused_unless_allowed(tmp_path) -> None:
    path = tmp_path / "cells.jsonl"
    CellCache(path, CONFIG, {"commit": "a" * 40, "dirty": False, "cpu": "Intel"}).put("a", {"accuracy": 0.5})
    here = {"commit": "b" * 40, "dirty": True, "cpu": "AMD"}

    with pytest.raises(CacheMismatch, match=f"commit {'a' * 40}, this checkout is {'b' * 40} \\(dirty\\)"):
        CellCache(path, CONFIG, here)
    kept = CellCache(path, CONFIG, here, allow_other_commit=True)
    assert kept.get("a") == {"accuracy": 0.5}
    assert json.loads(path.read_text().splitlines()[0])["provenance"]["commit"] == "a" * 40  # who wrote the cells


def test_a_stopped_comparison_resumes_from_its_cache(monkeypatch, capsys, tmp_path) -> None:
    ran: list[str] = []

    def run_setting(name, setting, data, rounds, train, arch="cnn", limits=None) -> dict:
        ran.append(f"{setting.label}/{name}")
        return {
            "accuracy": 0.5,
            "personalized_accuracy": 0.6,
            "upload_bytes_per_round": 1.0,
            "seconds": 2.0,
            "failed_rounds": 0,
        }

    monkeypatch.setattr(compare, "run_setting", run_setting)
    cells = tmp_path / "cells.jsonl"
    argv = ["--scenario", "domains", "--strategies", "fedavg,fedhm", "--seeds", "2", "--json", "--cache", str(cells)]
    assert compare.main(argv) == 0
    first = capsys.readouterr()
    assert len(ran) == 4

    assert compare.main(argv) == 0
    second = capsys.readouterr()
    assert len(ran) == 4  # nothing trained again
    assert json.loads(second.out) == json.loads(first.out)
    assert second.err.count("from the cache") == 4
    commit = json.loads(first.out)["provenance"]["commit"]
    assert list(json.loads(first.out)["provenance"]["cells_by_commit"].values()) == [4]
    assert next(iter(json.loads(first.out)["provenance"]["cells_by_commit"])).startswith(commit)

    assert compare.main([*argv, "--rounds", "3"]) == 2
    assert "--cache: " in (err := capsys.readouterr().err) and "differs in: rounds" in err


def test_cells_of_the_same_commit_with_other_uncommitted_changes_are_refused(tmp_path) -> None:
    path = tmp_path / "cells.jsonl"
    theirs = {"commit": "a" * 40, "dirty": True, "changes_sha256": "1" * 64}
    CellCache(path, CONFIG, theirs).put("a", {"accuracy": 0.5})
    assert CellCache(path, CONFIG, dict(theirs)).get("a") == {"accuracy": 0.5}  # the same edits: resumed
    with pytest.raises(CacheMismatch, match="\\(dirty\\) with other uncommitted changes: resuming would mix"):
        CellCache(path, CONFIG, theirs | {"changes_sha256": "2" * 64})


def test_each_cell_records_the_commit_that_computed_it_and_a_mixed_table_says_so(tmp_path) -> None:
    path = tmp_path / "cells.jsonl"
    first = {"commit": "a" * 40, "dirty": False}
    CellCache(path, CONFIG, first).put("seed 0", {"accuracy": 0.5})
    later = CellCache(path, CONFIG, {"commit": "b" * 40, "dirty": True, "changes_sha256": "c" * 64}, True)
    later.put("seed 1", {"accuracy": 0.6})

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["source"] for line in lines[1:]] == ["a" * 40, f"{'b' * 40}+dirty:{'c' * 12}"]
    assert later.commits(["seed 0", "seed 1", "seed 2"]) == {"a" * 40: 1, f"{'b' * 40}+dirty:{'c' * 12}": 1}
    assert CellCache(path, CONFIG, first, True).commits(["seed 0"]) == {"a" * 40: 1}  # kept across a reopen
