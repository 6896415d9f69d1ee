"""Every figure carries where it came from: the commit (and whether the tree was dirty), CPU, cores and torch."""

import re

import torch

from benchmarks.machine import describe


def test_a_description_names_the_commit_the_cpu_and_torch() -> None:
    machine = describe()
    assert re.fullmatch(r"[0-9a-f]{40}", machine["commit"]) and isinstance(machine["dirty"], bool)
    assert machine["cpu"] and machine["cores"] >= 1 and machine["torch"] == torch.__version__
    changes = machine["changes_sha256"]  # the uncommitted changes' hash, only for a dirty tree
    assert re.fullmatch(r"[0-9a-f]{64}", changes) if machine["dirty"] else changes is None
