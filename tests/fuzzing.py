"""Hypothesis settings for the property-based tests (the fuzzers).

``make test`` runs them bounded and derandomized (the same inputs every run: CI never fails on
a draw it did not make before); ``make fuzz`` sets ``MODELCACHE_FUZZ=1``: random draws, each
test's example count times ``MODELCACHE_FUZZ_SCALE`` (default 25), and failures kept in
``.work/hypothesis`` so the next run replays them first.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from tests.helpers import REPO

FUZZ = os.environ.get("MODELCACHE_FUZZ") == "1"
SCALE = int(os.environ.get("MODELCACHE_FUZZ_SCALE", "25")) if FUZZ else 1

_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]
settings.register_profile("ci", deadline=None, derandomize=True, database=None, suppress_health_check=_QUIET,
                          print_blob=True)
settings.register_profile("fuzz", deadline=None, suppress_health_check=_QUIET, print_blob=True,
                          database=DirectoryBasedExampleDatabase(str(REPO / ".work" / "hypothesis")))
settings.load_profile("fuzz" if FUZZ else "ci")


def examples(n: int) -> int:
    """``n`` examples under ``make test``, ``n * SCALE`` under ``make fuzz``."""
    return n * SCALE
