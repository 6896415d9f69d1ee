"""The kit's text files as templates in ``coordinator/provision/templates/`` (package data), not f-strings.

A template is named after the file it becomes (``install.sh``, ``fedfleet-agent.service``,
``user-data``, ``README.md``, ``agent.yaml``, ``mosquitto.conf``, ``acl``) or, for an optional
block of one, after that file and the block (``mosquitto-tls.conf``). Reading a template shows the
file a device or broker gets, and editing one needs no Python.

Placeholders are ``@name`` or ``@{name}`` (``string.Template`` with ``@`` as delimiter, ``@@`` for a
literal ``@``): the usual ``$`` would clash with every variable of the shell script. Every
placeholder must be given a value; a missing one is an error naming the template and the key.
"""

from __future__ import annotations

import string
from importlib import resources

PACKAGE = "coordinator.provision"
FOLDER = "templates"


class KitTemplate(string.Template):
    """``string.Template`` with ``@`` for ``$``: shell scripts and systemd units keep their ``$`` as they are."""

    delimiter = "@"


def template_text(name: str) -> str:
    """The template ``name`` as shipped in the package."""
    return (resources.files(PACKAGE) / FOLDER / name).read_text(encoding="utf-8")


def render(name: str, **values: object) -> str:
    """The template ``name`` with every ``@placeholder`` replaced by ``values``."""
    try:
        return KitTemplate(template_text(name)).substitute(values)
    except KeyError as exc:
        raise ValueError(f"template {FOLDER}/{name} needs a value for @{exc.args[0]}") from None
