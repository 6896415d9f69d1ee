"""A real agent process (``device-agent run --kit``) that stops in its Nth training, as a device losing power.

Run as ``python -m tests.e2e.agent_held_in_round KIT_DIR N [RELEASE]``: everything is the real agent (its session
over TLS, its secure-aggregation answers); only its Nth training never ends, or (with RELEASE, a file path) goes on
once that file exists. It logs :data:`HELD` first, so a test can wait for that line and kill the process there:
under secure aggregation the assignment comes after the key exchange, and the masked update leaves after
training, so that is mid-protocol. A released agent holds its round open until the test lets it go.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

from device_agent.agent.config import load_kit
from device_agent.agent.hooks import RuntimeHooks
from device_agent.agent.runtime import run_agent

HELD = "held in training"
log = logging.getLogger("fedfleet.agent")


class HeldInRound(RuntimeHooks):
    """Blocks its ``round``-th training until the process is killed, or until ``release`` exists."""

    def __init__(self, round_: int, release: Path | None = None) -> None:
        self.round, self.started, self.release = round_, 0, release

    def before_training(self, level: float) -> None:
        self.started += 1
        if self.started != self.round:
            return
        log.info("%s (training %d)", HELD, self.started)
        if self.release is None:
            threading.Event().wait()
            return
        while not self.release.exists():
            time.sleep(0.1)
        log.info("released (training %d)", self.started)


def main(kit: Path, round_: int, release: Path | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_agent(load_kit(kit), hooks=lambda _device: HeldInRound(round_, release))


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None))
