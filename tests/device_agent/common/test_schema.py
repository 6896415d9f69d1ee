"""What fleet.yaml, agent.yaml and the wire share: one name rule, one secret reference, one partition grammar."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from device_agent.common.schema import (
    Partition,
    SecretError,
    check_name,
    check_secret_ref,
    parse_partition,
    resolve_secret,
)


def test_names_are_topic_levels() -> None:
    assert check_name("device", "pi5-01.lab_2") == "pi5-01.lab_2"
    for bad in ("lab/pi", "+", "#", "-lead", "", "x" * 65):
        with pytest.raises(ValueError, match="invalid device name"):
            check_name("device", bad)


def test_secret_references_resolve_or_say_what_is_missing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FLEET_SECRET", "s3cret")
    assert resolve_secret("env:FLEET_SECRET") == "s3cret"
    (tmp_path / "pw").write_text("from-file\n")
    assert resolve_secret(f"file:{tmp_path / 'pw'}") == "from-file"
    with pytest.raises(SecretError, match="'NOT_SET_ANYWHERE' is not set"):
        resolve_secret("env:NOT_SET_ANYWHERE")
    with pytest.raises(SecretError, match="cannot read"):
        resolve_secret(f"file:{tmp_path / 'missing'}")


@pytest.mark.parametrize(
    ("ref", "message"),
    [("hunter2", "never the secret itself"), ("env:", "needs an environment variable name"), ("file:", "needs a path")],
)
def test_a_secret_itself_is_refused_without_echoing_it(ref: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_secret_ref(ref)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("iid", "iid"),
        ("permuted_labels", "permuted_labels"),
        ("dirichlet( 0.50 )", "dirichlet(0.5)"),
        ("domains", "domains"),  # fleet.yaml's spelling: two domains
        ("domains(3)", "domains(3)"),  # agent.yaml's
    ],
)
def test_both_files_read_one_partition_grammar(text: str, canonical: str) -> None:
    partition = parse_partition(text)
    assert partition.text == canonical
    assert Partition.model_validate(text) == partition == parse_partition(partition.text)


def test_a_partition_becomes_the_split_of_count_shares() -> None:
    assert parse_partition("domains").spec(count=8, seed=1).num_domains == 2
    assert parse_partition("domains(5)").spec(count=3, seed=1).num_domains == 3  # at most one per share
    spec = parse_partition("dirichlet(0.3)").spec(count=8, seed=1)
    assert (spec.scheme, spec.alpha, spec.num_clients, spec.seed) == ("dirichlet", 0.3, 8, 1)
    assert parse_partition("permuted_labels").spec(4, 0).permute_labels


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("shards", "'shards' is not a partition; use iid, permuted_labels, dirichlet"),
        ("dirichlet(lots)", "dirichlet alpha 'lots' is not a number"),
        ("dirichlet(-1)", "dirichlet alpha must be > 0"),
        ("dirichlet", "dirichlet needs its concentration alpha, e.g. dirichlet(0.5)"),
        ("domains(0)", "the number of domains must be a whole number >= 1"),
        ("iid(2)", "iid takes no argument"),
    ],
)
def test_a_bad_partition_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_partition(text)
