"""Which agents the coordinator works with: the wire protocol decides, the release number warns.

A device whose protocol version differs is refused by the session (it gets an ``incompatible``
error and stops). Within one protocol version an agent of another release still takes part, but
its numbers (probe, training loop) may differ from this release's: the coordinator says so once.
"""

from __future__ import annotations

from device_agent import __version__ as COORDINATOR_RELEASE


def release_note(agent_version: str) -> str | None:
    """A warning when ``agent_version``'s major.minor differs from this coordinator's release, else None."""
    if agent_version.split(".")[:2] == COORDINATOR_RELEASE.split(".")[:2]:
        return None
    return (
        f"agent {agent_version} is another release than this coordinator ({COORDINATOR_RELEASE}); it speaks the "
        "same protocol and takes part, but install the matching agent kit (coordinator provision) to be sure"
    )
