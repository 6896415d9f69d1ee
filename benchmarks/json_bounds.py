"""What refusing hostile control messages costs: the nesting scan next to json.loads, side by side.

    python -m benchmarks.json_bounds [--size-kib 1024] [--repeats 5] [--json]

Every control message is scanned for bracket depth before it is parsed (``device_agent/wire/
json_bounds.py``). Each input below is as big as a message may be; the scan must stay a small
fraction of what parsing a benign message of the same size costs, whatever the bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable

from device_agent.wire.json_bounds import nesting_depth
from device_agent.wire.messages import MAX_MESSAGE_BYTES, ProtocolError, parse_message


def _inputs(size: int) -> dict[str, bytes]:
    benign = json.dumps({"v": 3, "type": "nack", "transfer": "0" * 32, "missing": list(range(size // 9))})
    return {
        "benign_nack": benign.encode(),
        "nesting_bomb": b"[" * size,
        "empty_pairs": b"[]" * (size // 2),
        "escaped_quotes": b'"' + b'\\"' * ((size - 1) // 2),
        "long_string": b'"' + b"x" * (size - 2) + b'"',
    }


def _best_ms(action: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _parse(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_message(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.json_bounds", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-kib", type=int, default=MAX_MESSAGE_BYTES >> 10, help="input size (default 1024)")
    parser.add_argument("--repeats", type=int, default=5, help="best of N timings (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    inputs = _inputs(args.size_kib << 10)
    benign = inputs["benign_nack"]
    loads_ms = _best_ms(lambda: json.loads(benign), args.repeats)
    result: dict[str, object] = {
        "size_bytes": args.size_kib << 10,
        "benign_bytes": len(benign),
        "benign_json_loads_ms": round(loads_ms, 3),
    }
    for name, data in inputs.items():
        scan_ms = _best_ms(lambda data=data: nesting_depth(data), args.repeats)
        result[f"{name}_scan_ms"] = round(scan_ms, 3)
        result[f"{name}_parse_message_ms"] = round(_best_ms(lambda data=data: _parse(data), args.repeats), 3)
        result[f"{name}_scan_vs_benign_loads"] = round(scan_ms / loads_ms, 3)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.size_kib} KiB inputs; json.loads of a benign {len(benign)}-byte nack: {loads_ms:.2f} ms")
        for name in inputs:
            print(
                f"  {name:15s} scan {result[f'{name}_scan_ms']:8.2f} ms "
                f"(x{result[f'{name}_scan_vs_benign_loads']:.2f} of json.loads), "
                f"parse_message {result[f'{name}_parse_message_ms']:8.2f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
