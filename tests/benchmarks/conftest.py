"""The benchmarks' tests call their ``main()`` in this process, and a benchmark pins torch to one thread for its
process (``compare``, ``fedlora``, ``privacy`` and others do, as their command lines should): each test gets back
the thread count it started with, so no test runs with what an earlier one left (``test_cell_cache`` left the
whole rest of the session on one thread)."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def torch_threads_restored() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
