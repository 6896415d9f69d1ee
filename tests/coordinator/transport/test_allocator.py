"""The coordinator keeps freed upload buffers: re-filling chunk-sized buffers stops page-faulting."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="tunes glibc's allocator"
)

# Sixty-four "uploads" of sixteen 256 KiB chunks each, joined and freed, as the coordinator's ingest does;
# prints the minor page faults the loop took. Run in a fresh interpreter: the tuning is process-wide.
_UPLOADS = """
import os, resource, sys
from coordinator.transport.allocator import keep_freed_buffers
if sys.argv[1] == "tuned":
    assert keep_freed_buffers()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(64):
    chunks = [bytes(bytearray(os.urandom(16)) * (2**18 // 16)) for _ in range(16)]
    payload = b"".join(chunks)
    del chunks, payload
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _UPLOADS, mode], capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_tuned_process_reuses_freed_chunk_and_payload_buffers_instead_of_faulting_them_in_again() -> None:
    default, tuned = faults("default"), faults("tuned")
    # 64 uploads x 8 MiB written (chunks + joined payload) is ~131,000 pages; by default most of them
    # fault, tuned only the first upload's do.
    assert default > 50_000
    assert tuned < default / 5
