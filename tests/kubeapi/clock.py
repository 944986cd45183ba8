"""Timestamps as the API writes them (RFC 3339, seconds, UTC)."""

from __future__ import annotations

from datetime import UTC, datetime


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
