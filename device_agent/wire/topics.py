"""MQTT topic layout: one subtree per device, so broker ACLs can confine each device to its own.

    fedfleet/<fleet>/dev/<device>/up/data     device -> coordinator: control messages, manifests, chunks
    fedfleet/<fleet>/dev/<device>/up/status   device -> coordinator: retained status, last will
    fedfleet/<fleet>/dev/<device>/down/data   coordinator -> device: control messages, manifests, chunks

Everything a device writes is under ``up/`` and everything it reads under ``down/``: two pattern
ACL lines (``pattern write fedfleet/<fleet>/dev/%u/up/data`` and ``up/status``, ``pattern read .../%u/down/data``)
confine it. Manifests, chunks and control share one topic per direction so that MQTT's per-topic
ordering keeps a manifest ahead of its chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from device_agent.common.schema import check_name

ROOT = "fedfleet"


@dataclass(frozen=True)
class DeviceTopics:
    """The topics of one device in one fleet."""

    fleet: str
    device: str

    def __post_init__(self) -> None:
        check_name("fleet", self.fleet)
        check_name("device", self.device)

    @property
    def base(self) -> str:
        return f"{ROOT}/{self.fleet}/dev/{self.device}"

    @property
    def up(self) -> str:
        return f"{self.base}/up/data"

    @property
    def status(self) -> str:
        return f"{self.base}/up/status"

    @property
    def down(self) -> str:
        return f"{self.base}/down/data"


def fleet_uplinks(fleet: str) -> str:
    """The coordinator's subscription: every device's ``up`` subtree."""
    return f"{ROOT}/{check_name('fleet', fleet)}/dev/+/up/#"


def device_of(topic: str) -> str | None:
    """The device a topic belongs to; the broker's ACLs make it the authenticated sender for ``up``."""
    parts = topic.split("/")
    if len(parts) >= 4 and parts[0] == ROOT and parts[2] == "dev":
        return parts[3]
    return None


UPLINK_SUBTOPICS = ("data", "status")
"""The only sub-topics under a device's ``up/`` that carry anything (see the module doc)."""


def uplink_device(topic: str) -> str | None:
    """The device ``topic`` is a documented uplink of (``.../dev/<device>/up/data`` or ``up/status``), else None.

    A receiver reads nothing else: a made-up sub-topic must not get state of its own.
    """
    parts = topic.split("/")
    if len(parts) == 6 and parts[0] == ROOT and parts[2] == "dev" and parts[4] == "up" and parts[5] in UPLINK_SUBTOPICS:
        return parts[3]
    return None


def reply_topic(topic: str) -> str:
    """Where to answer a message that arrived on ``topic``: the same device's opposite direction."""
    parts = topic.split("/")
    if len(parts) != 6 or parts[0] != ROOT or parts[2] != "dev" or parts[4] not in ("up", "down"):
        raise ValueError(f"not a fedfleet device topic: {topic!r}")
    parts[4] = "down" if parts[4] == "up" else "up"
    parts[5] = "data"
    return "/".join(parts)


DOCTOR_PREFIX = "doctor@"


def doctor_login(device: str) -> str:
    """The read-only broker login ``device-agent doctor`` asks with whether ``device``'s agent is online.

    Never a device's login ('@' is not allowed in a device name), so logging in with it takes over no
    session; the broker's ACL lets it read the device's retained ``up/status`` and nothing else.
    """
    return DOCTOR_PREFIX + check_name("device", device)


def acl_patterns(fleet: str) -> list[str]:
    """Mosquitto ``pattern`` lines confining every device (its user name is its device name) to its documented topics.

    Exact topics, no wildcards: a device may not open sub-topics of its own (each would be state to keep).
    """
    base = f"{ROOT}/{check_name('fleet', fleet)}/dev/%u"
    return [*(f"pattern write {base}/up/{sub}" for sub in UPLINK_SUBTOPICS), f"pattern read {base}/down/data"]


def answered_on(topic: str) -> str:
    """Where a peer's transfers on ``topic`` are answered (its opposite ``data`` topic): the transfer engine's
    route, one per peer."""
    try:
        return reply_topic(topic)
    except ValueError:
        return topic  # not a device topic: only a session outside the fleet layout sees one
