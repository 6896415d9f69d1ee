"""Keep freed upload buffers in the coordinator process for the next uploads.

Uploads arrive as 256 KiB chunks and are joined into payloads of megabytes. Both sizes are above
glibc's default mmap threshold. Each buffer is then a fresh mapping, and when it is freed its pages
go back to the kernel, so the next upload faults on every 4 KiB page it writes. On the fan-in
benchmark (8 devices x 4 MiB, 2 cores) that was ~6,000 minor faults per round of uploads. With both
thresholds raised the faults drop to a few hundred and the ingest rate rises ~10-20 %. The cost is
that up to ``trim_bytes`` of freed memory stays with the process instead of going back to the OS.
64 MiB holds a fan-in round's buffers (8 x 4 MiB of chunks and their joins): the fan-in is as fast as
with 256 MiB, which made a coordinator taking 1,000 emulated devices' uploads of ~190 KB peak at 870-900
MiB of RSS against 710 MiB (freed upload buffers, kept).
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger("fedfleet.allocator")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (half its arena heap size); larger values are refused."""


def keep_freed_buffers(trim_bytes: int = 64 * 2**20, mmap_bytes: int = _MMAP_THRESHOLD_MAX) -> bool:
    """Raise glibc's trim and mmap thresholds for this process; False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1 and mallopt(_M_MMAP_THRESHOLD, mmap_bytes) == 1
    if not applied:
        log.debug("mallopt refused the thresholds (trim %d, mmap %d bytes)", trim_bytes, mmap_bytes)
    return applied
