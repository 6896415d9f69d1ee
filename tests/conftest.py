"""Suite-wide fixtures: real brokers (see tests/transport_fixtures.py), and how the fuzz tests run.

The property tests (hypothesis) run a fixed set of examples per test (``derandomize``), so a CI run
is repeatable; a generous deadline still fails an input that makes a parser hang or go quadratic,
without failing on a loaded 2-core machine's scheduling. ``HYPOTHESIS_PROFILE=explore`` draws fresh
examples (run it locally to look for new failures, then pin each with ``@example``).
"""

import atexit
import os
import shutil
import signal
import tempfile

from hypothesis import settings

from device_agent.data.mapped import CACHE_ENV
from tests.transport_fixtures import amqtt, fresh_mosquitto, mosquitto

settings.register_profile("ci", derandomize=True, deadline=10_000, database=None)
settings.register_profile("explore", deadline=10_000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# A shell that starts the suite in the background (`cmd &` without job control) leaves SIGINT ignored, and the
# agents and emulators the tests start would inherit that and never stop on SIGINT: handle it as Python does.
signal.signal(signal.SIGINT, signal.default_int_handler)

# Emulation maps fitted data sets from a cache folder (device_agent.data.mapped): the suite's own, not ~/.cache.
if CACHE_ENV not in os.environ:
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="fedfleet-data-cache-")
    atexit.register(shutil.rmtree, os.environ[CACHE_ENV], True)

__all__ = ["amqtt", "fresh_mosquitto", "mosquitto"]
