"""The ``coordinator`` console script: a clear message instead of a traceback where its extra is missing,
and for every user error (see :mod:`device_agent.cli.errors`).

``pip install fedfleet`` without ``[coordinator]`` (say, by mistake on a device) still installs this
command; devices install the agent kit's ``fedfleet-agent`` wheel, which has no coordinator at all.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from coordinator.cli.app import main as run
    except ImportError as exc:
        print(
            f"coordinator: {exc.name or exc} is not installed: the coordinator needs its extra, "
            "pip install 'fedfleet[coordinator]'. On a device, install its kit instead (command: device-agent).",
            file=sys.stderr,
        )
        return 2
    from device_agent.cli.errors import debug_requested, guarded

    return guarded("coordinator", run, user_errors(), debug_requested(sys.argv[1:]))


def user_errors() -> tuple[type[BaseException], ...]:
    """What a wrong setting or a busy or missing resource raises: one line for the user, not a traceback."""
    from coordinator.config.fleet import FleetError
    from coordinator.emulation.emulator import EmulatorError
    from coordinator.provision.secrets import ProvisionError
    from coordinator.run.report import ReportError
    from coordinator.run.rundir import RunDirError
    from coordinator.transport.broker.base import BrokerError
    from device_agent.agent.config import ConfigError
    from device_agent.agent.probe import DeviceUnavailable
    from device_agent.common.schema import SecretError
    from device_agent.data.datasets import DatasetError
    from profiles.catalog import ProfileError

    return (
        FleetError,
        BrokerError,
        EmulatorError,
        ProvisionError,
        ReportError,
        RunDirError,
        ConfigError,
        DatasetError,
        DeviceUnavailable,
        SecretError,
        ProfileError,
        OSError,
    )


if __name__ == "__main__":
    sys.exit(main())
