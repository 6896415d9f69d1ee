import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.cli.app import main
from coordinator.planning.model_stats import model_stats


def test_models_json_lists_ratio_params_upload_and_macs(capsys):
    assert main(["models", "--arch", "resnet18", "--num-classes", "10", "--ratios", "1,0.5,0.25,0.125", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["ratio"] for row in rows] == [1.0, 0.5, 0.25, 0.125]
    assert all(set(row) == {"ratio", "params", "upload_bytes", "macs"} for row in rows)
    assert [round(row["params"] / 1e6, 2) for row in rows] == [11.17, 4.16, 2.21, 1.24]
    assert all(row["upload_bytes"] == 4 * row["params"] for row in rows)
    assert rows[0]["macs"] == pytest.approx(555.4e6, rel=1e-3)
    macs = [row["macs"] for row in rows]
    assert macs == sorted(macs, reverse=True)


def test_upload_ratios_match_the_reference_for_resnet18():
    full = model_stats("resnet18", 1.0).upload_bytes
    ratios = [model_stats("resnet18", g).upload_bytes / full for g in (0.5, 0.25, 0.125)]
    assert ratios == pytest.approx([0.37, 0.20, 0.11], abs=0.01)


def test_ratios_accept_fractions_and_the_table_prints_them(capsys):
    assert main(["models", "--arch", "cnn", "--ratios", "1,1/4"]) == 0
    out = capsys.readouterr().out
    assert "1/4" in out and "cnn" in out


def test_bad_ratio_is_a_usage_error_that_names_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["models", "--ratios", "1,2"])
    assert exit_info.value.code == 2
    assert "rank ratio 2 is outside (0, 1]" in capsys.readouterr().err


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "models" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_runs():
    script = shutil.which("coordinator") or str(Path(sys.executable).with_name("coordinator"))
    if not Path(script).exists():
        pytest.skip("coordinator console script not installed")
    done = subprocess.run([script, "models", "--arch", "cnn", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout)[0]["ratio"] == 1.0


def test_the_coordinator_command_favours_its_one_socket_thread_for_the_gil(capsys):
    from device_agent.common.threads import IO_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        assert main(["profiles"]) == 0
        assert sys.getswitchinterval() == pytest.approx(IO_SWITCH_INTERVAL_S, rel=0.05)
    finally:
        sys.setswitchinterval(before)
