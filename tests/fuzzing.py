"""Hypothesis settings for the property-based tests (the fuzzers).

``make test`` runs them bounded and derandomized (the same inputs every run: CI never fails on
a draw it did not make before); ``make fuzz`` sets ``MODELCACHE_FUZZ=1``: random draws, each
test's example count times ``MODELCACHE_FUZZ_SCALE`` (default 25), and failures kept in
``.work/hypothesis`` so the next run replays them first.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
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


# -- byte-level damage, shared by the fuzzers of on-disk formats ------------------------------

_pos = st.integers(0, 1 << 20)
#: One edit of a byte string: a bit flip, a truncation, an insertion, a deletion, a repeated run.
mutation = st.one_of(
    st.tuples(st.just("flip"), _pos, st.integers(0, 7)),
    st.tuples(st.just("truncate"), _pos),
    st.tuples(st.just("insert"), _pos, st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), _pos, st.integers(1, 24)),
    st.tuples(st.just("duplicate"), _pos, st.integers(1, 64)),
)


def mutate(data: bytes, ops: list[tuple]) -> bytes:
    """``data`` with each edit of ``ops`` applied (positions wrap around its length)."""
    out = bytearray(data)
    for op in ops:
        at = op[1] % (len(out) + 1)
        if op[0] == "flip" and at < len(out):
            out[at] ^= 1 << op[2]
        elif op[0] == "truncate":
            del out[at:]
        elif op[0] == "insert":
            out[at:at] = op[2]
        elif op[0] == "delete":
            del out[at : at + op[2]]
        elif op[0] == "duplicate":
            out[at:at] = out[at : at + op[2]]
    return bytes(out)
