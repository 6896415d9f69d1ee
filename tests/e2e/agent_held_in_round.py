"""A real agent process (``device-agent run --kit``) that stops in its Nth training, as a device losing power.

Run as ``python -m tests.e2e.agent_held_in_round KIT_DIR N``: everything is the real agent (its session over
TLS, its secure-aggregation answers); only its Nth training never ends. It logs :data:`HELD` first, so a test
can wait for that line and kill the process there: under secure aggregation the assignment comes after the
key exchange, and the masked update leaves after training, so that is mid-protocol.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

from device_agent.agent.config import load_kit
from device_agent.agent.hooks import RuntimeHooks
from device_agent.agent.runtime import run_agent

HELD = "held in training"
log = logging.getLogger("fedfleet.agent")


class HeldInRound(RuntimeHooks):
    """Blocks its ``round``-th training until the process is killed."""

    def __init__(self, round_: int) -> None:
        self.round, self.started = round_, 0

    def before_training(self, level: float) -> None:
        self.started += 1
        if self.started == self.round:
            log.info("%s (training %d)", HELD, self.started)
            threading.Event().wait()


def main(kit: Path, round_: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_agent(load_kit(kit), hooks=lambda _device: HeldInRound(round_))


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
