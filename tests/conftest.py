"""Suite-wide fixtures: real brokers (see tests/transport_fixtures.py), and how the fuzz tests run.

The property tests (hypothesis) run a fixed set of examples per test (``derandomize``), so a CI run
is repeatable; a generous deadline still fails an input that makes a parser hang or go quadratic,
without failing on a loaded 2-core machine's scheduling. ``HYPOTHESIS_PROFILE=explore`` draws fresh
examples (run it locally to look for new failures, then pin each with ``@example``).
"""

import os

from hypothesis import settings

from tests.transport_fixtures import amqtt, fresh_mosquitto, mosquitto

settings.register_profile("ci", derandomize=True, deadline=10_000, database=None)
settings.register_profile("explore", deadline=10_000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

__all__ = ["amqtt", "fresh_mosquitto", "mosquitto"]
