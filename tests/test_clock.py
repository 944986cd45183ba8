"""The one RFC 3339 timestamp (modelcache/runtime/clock.py): what Kubernetes accepts for its time
fields (seconds, MicroTime) and our log lines start with."""

from __future__ import annotations

import datetime as dt

import pytest

from modelcache.runtime.clock import rfc3339

WHEN = dt.datetime(2026, 12, 1, 15, 50, 5, 123456, tzinfo=dt.UTC)


def test_utc_with_z_at_each_precision() -> None:
    assert rfc3339(WHEN) == "2026-12-01T15:50:05Z"
    assert rfc3339(WHEN, digits=3) == "2026-12-01T15:50:05.123Z"
    assert rfc3339(WHEN, digits=6) == "2026-12-01T15:50:05.123456Z"


def test_other_zones_and_unix_times_are_written_in_utc() -> None:
    plus2 = WHEN.astimezone(dt.timezone(dt.timedelta(hours=2)))
    assert rfc3339(plus2, digits=6) == "2026-12-01T15:50:05.123456Z"
    assert rfc3339(WHEN.timestamp(), digits=3) == "2026-12-01T15:50:05.123Z"


def test_now_reads_back_as_the_current_utc_time() -> None:
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    parsed = dt.datetime.fromisoformat(rfc3339())
    assert parsed.tzinfo is not None and parsed.utcoffset() == dt.timedelta(0)
    assert before <= parsed <= dt.datetime.now(dt.UTC)


def test_other_precisions_are_refused() -> None:
    with pytest.raises(ValueError, match="digits"):
        rfc3339(WHEN, digits=2)
