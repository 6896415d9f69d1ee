"""How emulated devices are spread over processes: one agent process each, or packed into workers.

A process per device gives each one hard OS caps (RLIMIT_AS, its own threads) but costs a whole
Python + torch runtime, ~300-370 MB, per device: a 24 GB host holds a few dozen. A worker
(:mod:`device_agent.emulation.worker`) hosts many devices in one runtime, holding each one's memory by
accounting, so hundreds fit. Small fleets keep the hard caps; past :data:`PACK_ABOVE` devices they
are packed, :data:`DEVICES_PER_WORKER` to a worker, unless the caller says how.
"""

from __future__ import annotations

import argparse
import math

PACK_ABOVE = 16
"""Fleets of more devices than this are packed into workers by default."""

DEVICES_PER_WORKER = 250
"""Default worker size: each virtual device adds a few threads and a few MB; 250 share one ~200 MB runtime.

At 1,000 devices on 2 cores, 4 workers of 250 against 16 of 64: peak PSS of the whole emulation 4.3 against
7.5 GiB, round 1 closed with every update in 86 against 117 s (runtimes, not devices, were the memory, and
hundreds more threads contending for the cores)."""


MAX_DEVICES_PER_WORKER = (1024 - 64) // 3
"""Most devices one worker can hold: paho-mqtt's network loop watches its connection with ``select()``, which
takes no file descriptor above 1023, and each device holds three (its TLS socket and paho's wake-up socket pair;
64 are left to the process). A device past the limit never connects, silently: paho reads select's ValueError
as a lost connection and retries forever (measured: 340 of 500 devices per worker connected)."""
WORKER_LIMIT_REASON = (
    "each device's MQTT connection takes 3 file descriptors, and paho-mqtt cannot watch one above 1023"
)


class PackingError(ValueError):
    """Worker counts that cannot hold the devices; the message names the flag."""


def pack(
    count: int,
    workers: int | None = None,
    per_worker: int | None = None,
    pack_above: int = PACK_ABOVE,
) -> list[range] | None:
    """The devices (indices 0..count-1) of each worker, as contiguous balanced slices; None: a process each.

    ``workers`` and/or ``per_worker`` force packing (``--workers``, ``--devices-per-worker``);
    otherwise fleets larger than ``pack_above`` are packed ``DEVICES_PER_WORKER`` to a worker.
    """
    if count < 1:
        raise PackingError(f"nothing to emulate: {count} devices")
    for flag, value in (("--workers", workers), ("--devices-per-worker", per_worker)):
        if value is not None and value < 1:
            raise PackingError(f"{flag} must be >= 1, got {value}")
    if workers is None and per_worker is None:
        if count <= pack_above:
            return None
        per_worker = DEVICES_PER_WORKER
    if workers is None:
        assert per_worker is not None
        workers = math.ceil(count / per_worker)
    elif per_worker is not None and workers * per_worker < count:
        raise PackingError(
            f"--workers {workers} x --devices-per-worker {per_worker} holds {workers * per_worker} devices, "
            f"fewer than the {count} to emulate"
        )
    workers = min(workers, count)
    if math.ceil(count / workers) > MAX_DEVICES_PER_WORKER:
        flag = "--devices-per-worker" if per_worker is not None else "--workers"
        raise PackingError(
            f"{flag}: {math.ceil(count / workers)} devices per worker, more than the {MAX_DEVICES_PER_WORKER} one "
            f"worker can hold ({WORKER_LIMIT_REASON}); use --workers {math.ceil(count / MAX_DEVICES_PER_WORKER)} "
            "or more"
        )
    size, extra = divmod(count, workers)
    slices, start = [], 0
    for index in range(workers):
        end = start + size + (1 if index < extra else 0)
        slices.append(range(start, end))
        start = end
    return slices


def describe(count: int, slices: list[range] | None) -> str:
    """One line for the user: how the devices are hosted."""
    if slices is None:
        return f"{count} agent processes (one per device, hard OS caps)"
    sizes = sorted({len(s) for s in slices})
    per = f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
    workers = f"{len(slices)} worker process{'es' if len(slices) > 1 else ''}"
    return f"{count} devices packed into {workers} ({per} per worker, memory held by accounting)"


def add_packing_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of both emulate commands that say how devices are spread over processes."""
    group = parser.add_argument_group(
        "packing (one process per device up to --pack-above devices, else workers hosting many)"
    )
    group.add_argument("--workers", type=int, metavar="N", help="pack the devices into N worker processes")
    group.add_argument(
        "--devices-per-worker", type=int, metavar="M", help=f"pack M devices per worker (default {DEVICES_PER_WORKER})"
    )
    group.add_argument(
        "--pack-above",
        type=int,
        default=PACK_ABOVE,
        metavar="K",
        help="pack automatically when there are more than K devices (default: %(default)s)",
    )


def add_batch_arguments(parser: argparse.ArgumentParser, batch_help: str, no_batch_help: str) -> None:
    """``--batch`` / ``--no-batch`` (``args.batch``: True, False, or None for the worker's default)."""
    batching = parser.add_mutually_exclusive_group()
    batching.add_argument("--batch", dest="batch", action="store_true", default=None, help=batch_help)
    batching.add_argument("--no-batch", dest="batch", action="store_false", help=no_batch_help)


def batch_flags(batch: bool | None) -> list[str]:
    """The flags that pass ``batch`` on to a command taking :func:`add_batch_arguments`."""
    return [] if batch is None else ["--batch" if batch else "--no-batch"]
