"""The ``coordinator`` console script: a clear message instead of a traceback where its extra is missing.

``pip install fedfleet`` without ``[coordinator]`` (say, by mistake on a device) still installs this
command; devices install the agent kit's ``fedfleet-agent`` wheel, which has no coordinator at all.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from coordinator.cli import main as run
    except ImportError as exc:
        print(
            f"coordinator: {exc.name or exc} is not installed: the coordinator needs its extra, "
            "pip install 'fedfleet[coordinator]'. On a device, install its kit instead (command: device-agent).",
            file=sys.stderr,
        )
        return 2
    return run()


if __name__ == "__main__":
    sys.exit(main())
