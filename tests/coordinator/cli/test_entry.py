"""The ``coordinator`` console script as a shell runs it: a reader that goes away is no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "fleet.yaml"
SCRIPT = "import sys; from coordinator.cli.entry import main; sys.argv[0] = 'coordinator'; sys.exit(main())"


@pytest.mark.slow
def test_output_piped_into_a_closed_reader_ends_with_one_line() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head` that has already exited
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, "plan", "--fleet", str(EXAMPLE), "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)

    assert done.returncode == 141
    assert done.stderr == "coordinator: output closed before it was all written (broken pipe)\n"
