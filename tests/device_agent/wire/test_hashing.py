import logging
import threading

import pytest

from device_agent.wire.hashing import HashingPool


def test_a_caller_waits_while_the_bytes_queued_for_hashing_are_at_the_bound():
    release, third_queued = threading.Event(), threading.Event()
    with HashingPool(threads=2, queued_bytes=100) as pool:

        def network_thread() -> None:
            pool.verify(60, lambda: release.wait(10))
            pool.verify(30, lambda: release.wait(10))  # 90 bytes: fits
            pool.verify(30, lambda: None)  # 120 would not: waits until the others are done
            third_queued.set()

        reader = threading.Thread(target=network_thread)
        reader.start()
        assert not third_queued.wait(0.3)
        assert pool.queued_bytes == 90
        release.set()
        assert third_queued.wait(60)
        reader.join(5)
    assert pool.queued_bytes == 0  # shutdown waited for the queued work


def test_one_item_larger_than_the_bound_still_goes_through():
    done = threading.Event()
    with HashingPool(threads=1, queued_bytes=10) as pool:
        pool.verify(1_000, done.set)
        assert done.wait(60)


def test_outgoing_hashing_is_an_executor_whose_map_keeps_order_and_whose_threads_end_at_shutdown():
    with HashingPool(threads=3) as pool:
        assert list(pool.map(lambda n: n * n, range(20))) == [n * n for n in range(20)]
        failed = pool.submit(int, "not a number")
        assert isinstance(failed.exception(5), ValueError)
        running = _hashing_threads()
    assert running - _hashing_threads() == 3
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(int, "1")


def _hashing_threads() -> int:
    return sum(t.name.startswith("fedfleet-sha256") for t in threading.enumerate())


def test_a_failing_item_is_logged_and_gives_its_bytes_back(caplog):
    done = threading.Event()

    def broken() -> None:
        raise TypeError("a bug in filing")

    with caplog.at_level(logging.ERROR, logger="fedfleet.wire"), HashingPool(threads=1, queued_bytes=10) as pool:
        pool.verify(10, broken)
        pool.verify(10, done.set)  # waits for the broken item's bytes: they must come back
        assert done.wait(60)
    assert "error verifying an inbound chunk" in caplog.text
    assert "a bug in filing" in caplog.text
