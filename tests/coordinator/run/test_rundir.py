"""The run directory, used the way the round engine uses it: create, accept uploads, close rounds, crash, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from coordinator.config.checkpoints import Retention
from coordinator.run.metrics import DeviceRoundMetrics, RoundMetrics
from coordinator.run.rundir import RoundNotOpen, RunDir, RunDirError, latest_unfinished, read_metrics

FLEET = "fleet: lab\nrounds:\n  count: 5\n  deadline_s: 30\ndevices:\n  - {class: pi4, count: 4}\n"


def model_state(value: float = 0.0) -> dict[str, torch.Tensor]:
    return {"conv.weight": torch.full((4, 3, 3, 3), value), "fc.bias": torch.arange(10.0) + value}


def upload(value: float) -> dict[str, torch.Tensor]:
    return {"conv.reduce": torch.full((2, 3, 1, 3), value), "conv.expand": torch.full((4, 2, 3, 1), value)}


def round_metrics(round_: int, devices: dict[str, str], accuracy: float | None = None) -> RoundMetrics:
    per_device = {
        name: DeviceRoundMetrics(
            device_class="pi4",
            ratio=0.5,
            bytes_up=1100,
            bytes_down=2200,
            payload_bytes=1000,
            train_seconds=1.5 if status == "accepted" else None,
            status=status,
        )
        for name, status in devices.items()
    }
    accepted = sum(status == "accepted" for status in devices.values())
    return RoundMetrics(
        round=round_,
        accuracy=0.5 + 0.01 * round_ if accuracy is None else accuracy,
        loss=1.0 / round_,
        participants=accepted,
        bytes_up=1100 * len(devices),
        bytes_down=2200 * len(devices),
        seconds=10.0,
        phases={"push": 1.0, "train": 8.0, "aggregate": 0.5},
        devices=per_device,
    )


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    return path


@pytest.fixture
def run(tmp_path: Path, fleet_file: Path):
    with RunDir.create(tmp_path / "run", fleet_file, model_state(0.0), seed=7) as rundir:
        yield rundir


def test_a_new_run_resumes_at_round_one_from_its_initial_state(run: RunDir) -> None:
    point = run.resume()
    assert point.next_round == 1 and point.last_completed_round == 0
    assert point.seed == 7 and point.run_id == run.run_id
    assert torch.equal(point.state["fc.bias"], torch.arange(10.0))
    assert point.journal == []
    assert (run.path / "fleet.yaml").read_text() == FLEET


def test_closed_rounds_are_resumed_after_reopening(tmp_path: Path, run: RunDir, fleet_file: Path) -> None:
    for round_ in (1, 2):
        assert run.accept_upload(round_, "pi-1", f"t{round_}", upload(round_), {"ratio": 0.5, "samples": 40})
        run.complete_round(round_, model_state(float(round_)), round_metrics(round_, {"pi-1": "accepted"}))
    run.close()

    with RunDir.open(run.path, fleet_file) as reopened:
        point = reopened.resume()
        assert point.next_round == 3
        assert torch.equal(point.state["conv.weight"], torch.full((4, 3, 3, 3), 2.0))
        assert point.journal == []
        assert [m.round for m in reopened.metrics()] == [1, 2]
        assert not reopened.journal_path(2).exists()


def test_journal_replay_after_a_crash_keeps_every_accepted_upload_once(run: RunDir, fleet_file: Path) -> None:
    assert run.accept_upload(1, "pi-1", "a", upload(1.0), {"ratio": 0.5, "samples": 10})
    assert run.accept_upload(1, "pi-2", "b", upload(2.0), {"ratio": 0.25, "samples": 20})
    # The ack to pi-1 was lost, so it retransmits: the journal refuses to count it twice.
    assert not run.accept_upload(1, "pi-1", "a", upload(1.0), {"ratio": 0.5, "samples": 10})
    run.close()  # the coordinator dies here: the lock goes with the process, the files stay

    with RunDir.open(run.path, fleet_file) as reopened:
        point = reopened.resume()
        assert point.next_round == 1
        assert [(e.device, e.transfer_id, e.meta["samples"]) for e in point.journal] == [
            ("pi-1", "a", 10),
            ("pi-2", "b", 20),
        ]
        replayed = [reopened.load_upload(entry) for entry in point.journal]
        assert torch.equal(replayed[1]["conv.reduce"], upload(2.0)["conv.reduce"])
        assert not reopened.accept_upload(1, "pi-2", "b", upload(2.0))
        assert reopened.accept_upload(1, "pi-3", "c", upload(3.0))
        assert [e.device for e in reopened.resume().journal] == ["pi-1", "pi-2", "pi-3"]


def test_uploads_accepted_from_several_threads_are_each_journaled_once(run: RunDir) -> None:
    def deliver(device: str) -> bool:
        return run.accept_upload(1, device, "t", upload(float(device[-1])))

    with ThreadPoolExecutor(max_workers=4) as pool:
        accepted = list(pool.map(deliver, [f"dev-{n % 6}" for n in range(12)]))  # every upload arrives twice
    assert sum(accepted) == 6
    entries = run.resume().journal
    assert sorted(e.device for e in entries) == [f"dev-{n}" for n in range(6)]
    assert all(run.load_upload(e)["conv.reduce"][0, 0, 0, 0] == float(e.device[-1]) for e in entries)


def test_a_torn_journal_append_is_dropped_and_the_committed_entries_survive(run: RunDir, fleet_file: Path) -> None:
    run.accept_upload(1, "pi-1", "a", upload(1.0))
    journal = run.journal_path(1)
    with open(journal / "index.jsonl", "a") as index:  # killed halfway through the next append
        index.write('{"round": 1, "device": "pi-2", "transf')
    (journal / "000002.safetensors").write_bytes(b"half a payload")  # its payload, never committed
    run.close()

    with RunDir.open(run.path, fleet_file) as reopened:
        assert [e.device for e in reopened.resume().journal] == ["pi-1"]
        assert not (journal / "000002.safetensors").exists()
        assert reopened.accept_upload(1, "pi-2", "b", upload(2.0))
        assert [e.device for e in reopened.resume().journal] == ["pi-1", "pi-2"]


def test_an_uncommitted_round_close_is_rolled_back_without_duplicate_metrics(run: RunDir, fleet_file: Path) -> None:
    run.accept_upload(1, "pi-1", "a", upload(1.0))
    # Crash after the state and the metrics line of round 1 were written but before run.json committed them.
    run._write_state(1, model_state(1.0))
    (run.path / "metrics.jsonl").write_text(round_metrics(1, {"pi-1": "accepted"}).model_dump_json() + "\n")
    run.close()

    with RunDir.open(run.path, fleet_file) as reopened:
        point = reopened.resume()
        assert point.next_round == 1
        assert torch.equal(point.state["fc.bias"], torch.arange(10.0))
        assert [e.device for e in point.journal] == ["pi-1"]
        assert reopened.metrics() == []
        reopened.complete_round(1, model_state(1.0), round_metrics(1, {"pi-1": "accepted"}))
        assert [m.round for m in reopened.metrics()] == [1]


def test_a_corrupt_journal_payload_is_refused(run: RunDir) -> None:
    run.accept_upload(1, "pi-1", "a", upload(1.0))
    entry = run.resume().journal[0]
    entry.path.write_bytes(entry.path.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(RunDirError, match=r"000001\.safetensors: sha256 does not match .*index\.jsonl"):
        run.load_upload(entry)


def test_resuming_with_a_changed_fleet_file_names_what_changed(run: RunDir, fleet_file: Path) -> None:
    run.close()
    fleet_file.write_text(FLEET.replace("deadline_s: 30", "deadline_s: 60") + "# a comment is not a change\n")
    with pytest.raises(RunDirError, match=r"differs from the snapshot") as error:
        RunDir.open(run.path, fleet_file)
    assert "rounds.deadline_s: 30 -> 60" in str(error.value)

    fleet_file.write_text(FLEET + "# a comment is not a change\n")
    RunDir.open(run.path, fleet_file).close()


def test_one_run_directory_one_coordinator(run: RunDir, fleet_file: Path) -> None:
    with pytest.raises(RunDirError, match=rf"in use by another coordinator \(pid {os.getpid()}\)"):
        RunDir.open(run.path, fleet_file)
    with pytest.raises(RunDirError, match="is not empty"):
        RunDir.create(run.path, fleet_file, model_state(), seed=1)


def test_opening_what_is_not_a_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="does not exist"):
        RunDir.open(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match=r"has no run\.json"):
        RunDir.open(tmp_path / "empty")


def test_rounds_close_in_order(run: RunDir) -> None:
    with pytest.raises(RunDirError, match="the open round is 1"):
        run.complete_round(2, model_state(), round_metrics(2, {}))
    with pytest.raises(RoundNotOpen, match="round 3 is not open"):
        run.accept_upload(3, "pi-1", "a", upload(1.0))


def test_retention_keeps_the_last_rounds_and_the_best(tmp_path: Path, fleet_file: Path) -> None:
    retention = Retention(keep_last=2, keep_best=True)
    with RunDir.create(tmp_path / "run", fleet_file, model_state(), seed=0, retention=retention) as rundir:
        for round_, accuracy in ((1, 0.5), (2, 0.9), (3, 0.6), (4, 0.7)):
            rundir.complete_round(round_, model_state(round_), round_metrics(round_, {}, accuracy=accuracy))
        assert sorted(p.name for p in (rundir.path / "state").iterdir()) == [
            "round-000002.safetensors",
            "round-000003.safetensors",
            "round-000004.safetensors",
        ]
        assert sorted(json.loads((rundir.path / "run.json").read_text())["states"]) == ["2", "3", "4"]


def test_a_corrupt_checkpoint_is_refused_and_the_run_resumes_from_the_last_good_one(
    tmp_path: Path, fleet_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with RunDir.create(tmp_path / "run", fleet_file, model_state(), seed=0) as rundir:
        for round_ in (1, 2):
            rundir.complete_round(round_, model_state(round_), round_metrics(round_, {}))
        rundir.accept_upload(3, "pi-1", "t1", upload(3.0))
        newest = rundir.state_path(2)
    data = bytearray(newest.read_bytes())
    data[-8:-4] = torch.tensor([float("nan")]).numpy().tobytes()  # NaN bytes: still a valid safetensors file
    newest.write_bytes(bytes(data))
    with caplog.at_level("ERROR"), RunDir.open(tmp_path / "run") as rundir:
        assert rundir.last_completed_round == 1
        point = rundir.resume()
        assert torch.equal(point.state["fc.bias"], model_state(1.0)["fc.bias"])
        assert point.journal == []
        assert [m.round for m in rundir.metrics()] == [1]
    assert "round-000002.safetensors is corrupt: its sha256 does not match" in caplog.text
    assert "resuming from round 1, the last good state" in caplog.text


def test_a_truncated_checkpoint_with_no_earlier_state_is_refused_by_name(tmp_path: Path, fleet_file: Path) -> None:
    retention = Retention(keep_last=1, keep_best=False)
    with RunDir.create(tmp_path / "run", fleet_file, model_state(), seed=0, retention=retention) as rundir:
        rundir.complete_round(1, model_state(1.0), round_metrics(1, {}))
        state = rundir.state_path(1)
    state.write_bytes(state.read_bytes()[:40])
    with pytest.raises(RunDirError, match=r"round-000001\.safetensors is corrupt.*no earlier round state is kept"):
        RunDir.open(tmp_path / "run")


def test_a_corrupt_journaled_upload_is_dropped_by_name(
    tmp_path: Path, fleet_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with RunDir.create(tmp_path / "run", fleet_file, model_state(), seed=0) as rundir:
        rundir.accept_upload(1, "pi-1", "t1", upload(1.0))
        rundir.accept_upload(1, "pi-2", "t2", upload(2.0))
        first = rundir.resume().journal[0].path
    first.write_bytes(first.read_bytes()[:-3])
    with caplog.at_level("ERROR"), RunDir.open(tmp_path / "run") as rundir:
        assert [entry.device for entry in rundir.resume().journal] == ["pi-2"]
        assert rundir.accept_upload(1, "pi-1", "t1-again", upload(1.0))
        journal = rundir.resume().journal
        assert [entry.device for entry in journal] == ["pi-2", "pi-1"]
        for entry, value in zip(journal, (2.0, 1.0), strict=True):  # neither payload overwrote the other
            assert torch.equal(rundir.load_upload(entry)["conv.reduce"], upload(value)["conv.reduce"])
    assert "pi-1's accepted upload for round 1 is dropped" in caplog.text


def test_metrics_are_validated_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="participants is 2 but 1 device"):
        RoundMetrics(**{**round_metrics(1, {"a": "accepted", "b": "late"}).model_dump(), "participants": 2})
    with pytest.raises(ValueError, match="less than or equal to 1"):
        RoundMetrics(**{**round_metrics(1, {}).model_dump(), "accuracy": 1.5})
    with pytest.raises(ValueError, match="phases add up to more"):
        RoundMetrics(**{**round_metrics(1, {}).model_dump(), "phases": {"train": 11.0}})


def test_a_bad_metrics_line_is_named_by_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    good = round_metrics(1, {"pi-1": "accepted"}).model_dump()
    bad = {**good, "round": 2, "devices": {"pi-1": {**good["devices"]["pi-1"], "status": "lost"}}}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RunDirError, match=r"metrics\.jsonl line 2: devices\.pi-1\.status: Input should be"):
        read_metrics(path)


@pytest.mark.slow
def test_a_coordinator_killed_mid_round_loses_no_accepted_upload(tmp_path: Path, fleet_file: Path) -> None:
    """A real process accepts uploads and is killed -9 in the middle of persisting the next one."""
    RunDir.create(tmp_path / "run", fleet_file, model_state(), seed=3).close()
    child = textwrap.dedent(
        f"""
        import os, sys, time, torch
        from coordinator.run.rundir import RunDir
        rundir = RunDir.open({str(tmp_path / "run")!r})
        for n in range(3):
            assert rundir.accept_upload(1, f"dev-{{n}}", f"t{{n}}", {{"w": torch.full((256,), float(n))}})
            print(f"acked dev-{{n}}", flush=True)
        os.fsync = lambda fd: time.sleep(60)  # the disk stalls while persisting the fourth upload
        rundir.accept_upload(1, "dev-3", "t3", {{"w": torch.zeros(256)}})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    acked = [proc.stdout.readline().strip() for _ in range(3)]
    assert acked == ["acked dev-0", "acked dev-1", "acked dev-2"]
    journal = tmp_path / "run" / "journal" / "round-000001"
    while not any(p.name.startswith(".tmp-") for p in journal.iterdir()):
        assert proc.poll() is None
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    with RunDir.open(tmp_path / "run", fleet_file) as rundir:
        entries = rundir.resume().journal
        assert [e.device for e in entries] == ["dev-0", "dev-1", "dev-2"]
        assert [rundir.load_upload(e)["w"][0].item() for e in entries] == [0.0, 1.0, 2.0]
        assert not any(p.name.startswith(".tmp-") for p in journal.iterdir())


@pytest.mark.parametrize(
    "line",
    ["[" * 100_000, '{"round": Infinity, "device": "pi-2"}', '["round"]', '{"round": 1}'],
    ids=["nesting-bomb", "infinite-round", "not-an-object", "incomplete"],
)
def test_an_unreadable_journal_line_is_named_by_file_and_line(run: RunDir, fleet_file: Path, line: str) -> None:
    run.accept_upload(1, "pi-1", "a", upload(1.0))
    with open(run.journal_path(1) / "index.jsonl", "a") as index:
        index.write(line + "\n")
    run.close()
    with pytest.raises(RunDirError, match=r"index\.jsonl line 2: not a journal entry"):
        RunDir.open(run.path, fleet_file)


def test_a_plain_start_resumes_the_fleets_newest_run_only_while_it_is_unfinished(tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text("fleet: lab\n")
    runs = tmp_path / "runs"
    assert latest_unfinished(runs, "lab", rounds=2) is None
    with RunDir.create(runs / "lab-20261128-100000", fleet_file, model_state(), seed=0) as old:
        old.complete_round(1, model_state(1.0), round_metrics(1, {"a": "accepted"}))
    with RunDir.create(runs / "lab-20261128-110000", fleet_file, model_state(), seed=0) as newest:
        newest.complete_round(1, model_state(1.0), round_metrics(1, {"a": "accepted"}))

    assert latest_unfinished(runs, "lab", rounds=2) == runs / "lab-20261128-110000"
    assert latest_unfinished(runs, "lab", rounds=1) is None  # the newest is complete: the old one is not picked up
    assert latest_unfinished(runs, "other-fleet", rounds=2) is None
