"""Validation errors read as key paths, and an unknown key is answered with the closest known one."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from device_agent.agent.config import ConfigError, parse_config
from device_agent.common.validation import describe, keys_at, with_hints


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Mqtt(_Strict):
    kind: Literal["mqtt"] = "mqtt"
    keepalive_s: float = 60


class Local(_Strict):
    kind: Literal["local"] = "local"
    queue_size: int = 8


class Node(_Strict):
    name: str
    link: Mqtt | Local | None = None
    tags: dict[str, Mqtt] = Field(default_factory=dict)


class Site(_Strict):
    nodes: list[Node]
    log_level: str = "INFO"


def _error(data: dict) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        Site.model_validate(data)
    return info.value


def test_an_unknown_key_gets_the_closest_key_of_its_own_mapping() -> None:
    exc = _error({"nodes": [{"name": "a", "nmae": "b"}], "log_levl": "DEBUG"})
    assert describe(exc, sep="\n", model=Site).splitlines() == [
        "nodes[0].nmae: Extra inputs are not permitted (did you mean 'name'?)",
        "log_levl: Extra inputs are not permitted (did you mean 'log_level'?)",
    ]


def test_a_key_nothing_resembles_gets_no_guess_and_no_model_means_no_guess() -> None:
    exc = _error({"nodes": [], "colour": "red"})
    assert describe(exc, model=Site) == "colour: Extra inputs are not permitted"
    assert describe(_error({"nodes": [], "log_levl": 1})) == "log_levl: Extra inputs are not permitted"


def test_keys_are_found_through_unions_lists_and_dicts() -> None:
    assert keys_at(Site, ("nodes", 0, "link")) == ["keepalive_s", "kind", "queue_size"]
    assert keys_at(Site, ("nodes", 0, "link", "Local")) == ["kind", "queue_size"]
    assert keys_at(Site, ("nodes", 3, "tags", "any-key")) == ["keepalive_s", "kind"]


def test_a_nested_validation_keeps_its_hints_under_the_outer_key() -> None:
    """What fleet.yaml's strategy.params do: a validator validates another model and raises its errors."""
    with pytest.raises(ValidationError) as inner:
        Mqtt.model_validate({"keepalive": 5, "kind": "tcp"})
    hinted = with_hints(inner.value, Mqtt)
    assert [e["msg"] for e in hinted.errors()] == [
        "Input should be 'mqtt'",
        "Extra inputs are not permitted (did you mean 'keepalive_s'?)",
    ]


def test_agent_yaml_keys_get_the_same_answer() -> None:
    raw = {
        "device": "a",
        "fleet": "f",
        "transport": {"broker": {"url": "mqtt://x", "pasword": "env:X"}},
        "stat_dir": "/tmp",
    }
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert "broker.pasword: Extra inputs are not permitted (did you mean 'password'?)" in str(info.value)
    assert "stat_dir: Extra inputs are not permitted (did you mean 'state_dir'?)" in str(info.value)
