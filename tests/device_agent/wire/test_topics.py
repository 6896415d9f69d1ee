import pytest

from device_agent.wire.topics import DeviceTopics, acl_patterns, device_of, fleet_uplinks, reply_topic


def test_each_device_has_its_own_subtree_and_replies_go_the_other_way():
    t = DeviceTopics("lab", "pi-1")
    assert t.up == "fedfleet/lab/dev/pi-1/up/data"
    assert t.down == "fedfleet/lab/dev/pi-1/down/data"
    assert reply_topic(t.up) == t.down and reply_topic(t.down) == t.up
    assert reply_topic(t.status) == t.down
    assert device_of(t.status) == "pi-1"
    assert fleet_uplinks("lab") == "fedfleet/lab/dev/+/up/#"
    assert acl_patterns("lab") == [
        "pattern write fedfleet/lab/dev/%u/up/data",
        "pattern write fedfleet/lab/dev/%u/up/status",
        "pattern read fedfleet/lab/dev/%u/down/data",
    ]


@pytest.mark.parametrize("name", ["", "a/b", "+", "#", "a b", "-x"])
def test_names_that_would_escape_a_subtree_are_refused(name):
    with pytest.raises(ValueError, match="invalid device name"):
        DeviceTopics("lab", name)
