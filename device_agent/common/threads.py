"""The GIL's hand-over for a process with a few busy socket threads (the coordinator).

A thread that returns from a socket read must take the GIL back from whichever thread holds it, and it
waits up to the switch interval (5 ms by default) for it. A coordinator with a thousand devices' frames
in flight reads thousands of packets per round on one network thread, so that wait, not any work, set
its pace: at most ~200 reads a second while another thread computed (the "convoy effect" of
python/cpython#51998 / bpo-7946).

Not for a worker hosting hundreds of device threads: every thread waiting for the GIL wakes once per
interval to ask for it, and at 0.5 ms 400 waiting threads per worker took a 1,000-device host to a load
average of 979 and its devices past their keepalive (measured).
"""

from __future__ import annotations

import sys

IO_SWITCH_INTERVAL_S = 0.0005
"""Switch interval for a process of socket threads: a reading thread waits at most this for the GIL."""


def favour_io_threads() -> None:
    """Shorten the switch interval to :data:`IO_SWITCH_INTERVAL_S` (never lengthen one set shorter)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), IO_SWITCH_INTERVAL_S))
