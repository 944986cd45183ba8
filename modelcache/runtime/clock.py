"""The one RFC 3339 timestamp of the project: UTC with a ``Z``, as Kubernetes writes its times
(status fields, conditions, Events, Lease MicroTime), our manifests record them and our log
lines start."""

from __future__ import annotations

import datetime as dt


def rfc3339(when: dt.datetime | float | None = None, digits: int = 0) -> str:
    """``when`` (a datetime, a Unix time, or now) in UTC as ``2026-12-01T15:50:05Z``, with
    ``digits`` (0, 3 or 6) of the second's fraction: 6 is Kubernetes' MicroTime, 3 our logs'."""
    if digits not in (0, 3, 6):
        raise ValueError(f"digits must be 0, 3 or 6, not {digits}")
    if when is None:
        when = dt.datetime.now(dt.UTC)
    elif not isinstance(when, dt.datetime):
        when = dt.datetime.fromtimestamp(when, dt.UTC)
    text = when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if digits:
        text += f".{when.microsecond:06d}"[: digits + 1]
    return text + "Z"
