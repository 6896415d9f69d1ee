"""coordinator export: parity with torch for every kind of model a run can give a device."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml

from coordinator.cli.app import main as coordinator_main
from coordinator.config.fleet import FleetError, load_fleet, parse_fleet
from coordinator.run.exporting import export_finished_run, open_trained_run
from coordinator.run.report import write_report
from device_agent.data.datasets import FASHION_MNIST_DIR
from device_agent.infer import Classifier, model_info
from device_agent.layers.hybrid import factorization_plan
from export.check import FP32_TOLERANCE, ParityError, check_parity, session
from export.records import read_exports
from export.runner import ExportOptions, ExportRecord, export_run
from export.targets import ExportError, TrainedRun, build_target, load_run_data
from tests.export.runs import make_run


def _convs(path: Path) -> int:
    return sum(node.op_type == "Conv" for node in onnx.load(str(path)).graph.node)


def _assert_parity(record: ExportRecord, samples: int = 64) -> None:
    assert record.max_abs_diff <= FP32_TOLERANCE
    assert record.top1_agreement == 1.0
    assert record.parity_samples == samples


@pytest.mark.slow
def test_resnet18_merged_and_quarter_rank(resnet18_run: Path, tmp_path: Path) -> None:
    run = open_trained_run(resnet18_run)
    fast = {"parity_samples": 16, "latency": False}
    merged = export_run(run, ExportOptions(out=tmp_path / "merged.onnx", merged=True, **fast))
    quarter = export_run(run, ExportOptions(out=tmp_path / "quarter.onnx", ratio=0.25, **fast))
    for record in (merged, quarter):
        _assert_parity(record, 16)
        assert record.exporter == "dynamo" and record.opset >= 18
    # ResNet-18 has 20 convs; at gamma < 1 each of the 14 factorized ones stays two Conv nodes.
    factorized = sum(spec.is_conv for spec in factorization_plan("resnet18").values())
    assert (factorized, _convs(tmp_path / "merged.onnx")) == (14, 20)
    assert _convs(tmp_path / "quarter.onnx") == 20 + factorized
    assert quarter.bytes < 0.3 * merged.bytes
    assert not list(tmp_path.glob("*.data")), "the model must be one self-contained file"


@pytest.mark.slow
def test_small_cnn_and_resnet9(cnn_export: ExportRecord, tmp_path: Path) -> None:
    _assert_parity(cnn_export)
    assert cnn_export.target == "ratio:1/2" and cnn_export.latency_ms_b1 > 0 and cnn_export.latency_ms_b32 > 0
    run9 = open_trained_run(make_run(tmp_path / "r9", "resnet9", "fedhm", image_size=16, in_channels=3, samples=16))
    _assert_parity(export_run(run9, ExportOptions(out=tmp_path / "r9.onnx", ratio=0.25, latency=False)))


@pytest.mark.slow
def test_personalized_factorized_fl_models(ffl_run: Path, tmp_path: Path) -> None:
    run = open_trained_run(ffl_run)
    assert run.personal_devices == ("dev-a", "dev-b")
    records = {
        d: export_run(run, ExportOptions(out=tmp_path / f"{d}.onnx", personal=d, latency=False))
        for d in run.personal_devices
    }
    for record in records.values():
        _assert_parity(record)
    x = load_run_data(run).test_x[:16].numpy()
    a = session(tmp_path / "dev-a.onnx").run(None, {"input": x})[0]
    b = session(tmp_path / "dev-b.onnx").run(None, {"input": x})[0]
    assert np.abs(a - b).max() > 1e-3, "each device's personalized model is its own"
    meta = model_info(_props(tmp_path / "dev-a.onnx"))
    assert meta.metadata["personal"] == "dev-a" and meta.metadata["strategy"] == "factorized_fl"


def test_factorized_fl_without_the_devices_kept_state_says_how_to_get_it(ffl_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(ffl_run, copy, ignore=shutil.ignore_patterns("agents"))
    with pytest.raises(ExportError, match="--device-state"):
        build_target(open_trained_run(copy), personal="dev-a")
    kept = next((ffl_run / "agents" / "dev-a").rglob("*.kept.safetensors"))
    target = build_target(open_trained_run(copy), personal="dev-a", device_state=kept)
    assert target.kind == "personal"


def _props(path: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def test_metadata_is_everything_a_device_needs(cnn: TrainedRun, cnn_export: ExportRecord) -> None:
    info = model_info(_props(Path(cnn_export.file)))
    assert info.input_shape == (1, 8, 8)
    assert info.class_names == [str(i) for i in range(10)]
    assert info.mean == [0.0] and info.std == [1.0] and info.scale == pytest.approx(1 / 255)
    meta = info.metadata
    assert meta["run_id"] == cnn.run_id and meta["round"] == 1 and meta["strategy"] == "fedhm"
    assert meta["ratio"] == 0.5 and meta["exporter"] == "dynamo"
    sess = session(Path(cnn_export.file))
    assert isinstance(sess.get_inputs()[0].shape[0], str), "batch dimension must be dynamic"
    for batch in (1, 7):
        assert sess.run(None, {"input": np.zeros((batch, 1, 8, 8), np.float32)})[0].shape == (batch, 10)


def test_legacy_exporter_for_old_runtimes(cnn: TrainedRun, tmp_path: Path) -> None:
    record = export_run(cnn, ExportOptions(out=tmp_path / "old.onnx", merged=True, opset=13, latency=False))
    _assert_parity(record)
    assert record.exporter == "legacy" and record.opset == 13


def test_int8_quantization_reports_accuracy_next_to_fp32(cnn: TrainedRun, cnn_export: ExportRecord) -> None:
    q = cnn_export.int8
    assert q is not None and Path(q["file"]).is_file() and q["bytes"] < cnn_export.bytes
    assert q["test_samples"] == len(load_run_data(cnn).test_y)
    assert q["accuracy_drop"] == pytest.approx(cnn_export.accuracy - q["accuracy"])
    assert Classifier(q["file"]).info.class_names[0] == "0", "metadata survives quantization"


def test_parity_failure_is_an_error(cnn: TrainedRun, cnn_export: ExportRecord) -> None:
    target = build_target(cnn, ratio=0.5)
    with torch.no_grad():
        next(target.reference.parameters()).add_(0.5)
    with pytest.raises(ParityError, match="differs from torch"):
        check_parity(Path(cnn_export.file), target.reference, load_run_data(cnn).test_x[:8])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ratio": 0.125}, r"0\.125|1/8 is not one of the run's rank ratios \(1, 1/2, 1/4\)"),
        ({"personal": "dev-a"}, "--personal needs a personalized strategy"),
        ({"merged": True, "ratio": 0.5}, "exactly one of"),
    ],
)
def test_clear_errors(cnn: TrainedRun, kwargs: dict, message: str) -> None:
    with pytest.raises(ExportError, match=message):
        build_target(cnn, **kwargs)


def test_ratio_on_a_personalized_strategy_and_unknown_device(ffl_run: Path) -> None:
    run = open_trained_run(ffl_run)
    with pytest.raises(ExportError, match="--ratio needs a strategy whose levels are rank ratios"):
        build_target(run, ratio=0.5)
    with pytest.raises(ExportError, match="'nope' has no personalized model in round 1"):
        build_target(run, personal="nope")


def test_missing_round(cnn_run: Path) -> None:
    with pytest.raises(ExportError, match=r"round 5 has no saved state .*last completed round: 1; saved: 0, 1"):
        open_trained_run(cnn_run, 5)
    assert open_trained_run(cnn_run, 0).round == 0


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist")
def test_a_fashion_mnist_run_exports_by_hand_with_its_class_names(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, arch="cnn28", dataset="fashion_mnist", ratios=("1", "1/4"))
    out = tmp_path / "merged.onnx"
    args = ["export", str(run_dir), "--merged", "--out", str(out), "--no-latency", "--parity-samples", "8"]
    assert coordinator_main(args) == 0
    classes = model_info(_props(out)).class_names
    assert classes[0] == "T-shirt/top" and classes[9] == "Ankle boot"


def test_a_run_whose_data_moved_exports_with_data_and_says_so_without(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A user's npz data set: the run recorded where it was; after it moves, --data points export at it."""
    images = np.random.default_rng(0).random((40, 8, 8), dtype=np.float32)
    np.savez(tmp_path / "mine.npz", x=images, y=np.arange(40) % 10)
    run_dir = make_run(tmp_path / "run", dataset="npz", dataset_path=tmp_path / "mine.npz", samples=8)
    moved = (tmp_path / "mine.npz").rename(tmp_path / "elsewhere.npz")
    args = ["export", str(run_dir), "--merged", "--out", str(tmp_path / "m.onnx"), "--no-latency"]
    assert coordinator_main([*args, "--parity-samples", "4"]) == 2
    error = capsys.readouterr().err
    assert f"data set is not at {tmp_path / 'mine.npz'} on this machine" in error and "--data PATH" in error
    assert coordinator_main([*args, "--parity-samples", "4", "--data", str(moved)]) == 0
    assert "top-1 agreement 100.0%" in capsys.readouterr().out
    assert coordinator_main([*args, "--data", str(tmp_path / "nowhere.npz")]) == 2
    assert "--data " + str(tmp_path / "nowhere.npz") + ": no such file or folder" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_exports_records_and_reports(cnn_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "pi4.onnx"
    args = ["export", str(cnn_run), "--ratio", "1/4", "--out", str(out), "--no-latency", "--parity-samples", "8"]
    assert coordinator_main(args) == 0
    printed = capsys.readouterr().out
    assert "ratio:1/4" in printed and "top-1 agreement 100.0%" in printed
    rows = [r for r in read_exports(cnn_run) if r["file"] == str(out.resolve())]
    assert rows and rows[-1]["bytes"] == out.stat().st_size
    assert str(out.resolve()) in write_report(cnn_run).read_text()
    assert coordinator_main(["export", str(cnn_run), "--ratio", "1/8", "--out", str(out)]) == 2
    assert "not one of the run's rank ratios" in capsys.readouterr().err


def test_help_reads_well(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        coordinator_main(["export", "--help"])
    text = capsys.readouterr().out
    for needle in ("--merged", "--ratio G", "--personal DEVICE", "--quantize", "device-agent infer"):
        assert needle in text


def test_exports_json_lines_are_json(cnn_run: Path) -> None:
    for line in (cnn_run / "exports.jsonl").read_text().splitlines():
        assert json.loads(line)["max_abs_diff"] <= FP32_TOLERANCE


@pytest.mark.slow
def test_fleet_export_section_runs_at_the_end_and_is_checked(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "auto", export={"merged": False, "ratios": ["1/2"], "dir": "onnx"})
    fleet, _ = load_fleet(run_dir / "fleet.yaml")
    export_finished_run(fleet, run_dir)
    out = run_dir / "onnx" / "ratio-1_2.onnx"
    assert out.is_file() and read_exports(run_dir)[-1]["file"] == str(out.resolve())
    bad = yaml.safe_load((run_dir / "fleet.yaml").read_text())
    bad["export"] = {"ratios": ["1/8"], "personal": ["dev-a", "ghost"]}
    with pytest.raises(FleetError) as error:
        parse_fleet(bad)
    message = str(error.value)
    assert "export.ratios: 1/8 is not one of the fleet's ratios" in message
    assert "export.personal: the strategy is not personalized" in message
