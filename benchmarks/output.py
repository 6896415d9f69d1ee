"""How a benchmark prints its result: one JSON object for the suite (``--json``), else one line per key."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def print_result(result: Mapping[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
