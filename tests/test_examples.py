import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.slow
def test_fedhm_round_example_learns_digits():
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fedhm_round.py"), "--rounds", "5"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    last = done.stdout.strip().splitlines()[-1]
    accuracy = float(last.split("global test accuracy ")[1].split(";")[0])
    assert accuracy > 0.8, done.stdout
