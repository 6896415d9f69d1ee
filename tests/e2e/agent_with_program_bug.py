"""An agent process whose client program has a bug in its first round.

Run as ``python -m tests.e2e.agent_with_program_bug AGENT_YAML``: every client program is wrapped by
:func:`tests.program_bugs.with_first_upload_bug`; everything else is the real ``device-agent run``
(:func:`run_agent` with its signals, session and outbox).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from device_agent.agent.config import load_config
from device_agent.agent.runtime import run_agent
from device_agent.clients import PROGRAMS
from tests.program_bugs import with_first_upload_bug


def main(agent_yaml: Path) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, program in list(PROGRAMS.items()):
        PROGRAMS[name] = with_first_upload_bug(program)
    return run_agent(load_config(agent_yaml))


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
