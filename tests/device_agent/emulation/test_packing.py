"""How emulated devices are spread over processes: a process each for small fleets, workers past a threshold."""

from __future__ import annotations

import pytest

from device_agent.emulation.packing import (
    DEVICES_PER_WORKER,
    MAX_DEVICES_PER_WORKER,
    PACK_ABOVE,
    PackingError,
    describe,
    pack,
)


def test_small_fleets_get_a_process_per_device_with_hard_caps() -> None:
    assert pack(1) is None
    assert pack(PACK_ABOVE) is None
    assert "one per device" in describe(9, pack(9))


def test_past_the_threshold_devices_are_packed_into_balanced_workers() -> None:
    slices = pack(300)
    assert slices is not None
    assert len(slices) == -(-300 // DEVICES_PER_WORKER)
    assert [i for s in slices for i in s] == list(range(300))  # every device once, in order
    assert max(map(len, slices)) - min(map(len, slices)) <= 1
    assert pack(PACK_ABOVE + 1) == [range(PACK_ABOVE + 1)]


def test_workers_or_devices_per_worker_override_the_choice() -> None:
    assert pack(6, workers=2) == [range(0, 3), range(3, 6)]
    assert pack(7, per_worker=3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert pack(6, pack_above=4) == [range(6)]
    assert pack(3, workers=8) == [range(0, 1), range(1, 2), range(2, 3)]  # never an empty worker
    assert describe(7, pack(7, workers=2)) == (
        "7 devices packed into 2 worker processes (3-4 per worker, memory held by accounting)"
    )


@pytest.mark.parametrize(
    ("count", "workers", "per_worker", "message"),
    [
        (10, 2, 4, r"--workers 2 x --devices-per-worker 4 holds 8 devices, fewer than the 10"),
        (10, 0, None, r"--workers must be >= 1, got 0"),
        (10, None, -1, r"--devices-per-worker must be >= 1, got -1"),
        (0, None, None, r"nothing to emulate"),
        (
            1000,
            2,
            None,
            r"--workers: 500 devices per worker, more than the 320 one worker can hold.*--workers 4 or more",
        ),
        (1000, None, 500, r"--devices-per-worker: 500 devices per worker, more than the 320"),
    ],
)
def test_impossible_packings_are_refused_naming_the_flag(
    count: int, workers: int | None, per_worker: int | None, message: str
) -> None:
    with pytest.raises(PackingError, match=message):
        pack(count, workers, per_worker)


def test_the_default_packing_stays_within_what_one_worker_can_hold() -> None:
    assert DEVICES_PER_WORKER <= MAX_DEVICES_PER_WORKER == 320
    slices = pack(2000)
    assert slices is not None and len(slices) == 8 and max(map(len, slices)) == DEVICES_PER_WORKER
    assert max(map(len, pack(1000, workers=4) or [])) == 250
