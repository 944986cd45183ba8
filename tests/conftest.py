"""Loads every fixture module under tests/fixtures/ as a pytest plugin, and the test tiers.

Each backend keeps its server fixtures in its own module there, so adding a backend never
edits a shared file. Each such module says what its fixtures need (``TIER``, ``GO_BUILD``), and
tests/tiers.py marks every test ``unit``, ``servers`` or ``cluster`` (and ``go``) from the
fixtures it requests: `make check` runs the unit tier, `make test-servers` everything that needs
no Go build, `make test` all of it (docs/development.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Fixture modules import each other's types (s3.py the TLS pair): rewrite their asserts whichever
# is imported first.
pytest.register_assert_rewrite("tests.fixtures")

pytest_plugins = [
    "tests.tiers",
    *sorted(f"tests.fixtures.{p.stem}" for p in (Path(__file__).parent / "fixtures").glob("*.py")
            if p.stem != "__init__"),
]


def _large(value: object) -> bool:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value) > 4096
    if isinstance(value, dict):
        return any(_large(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_large(v) for v in value)
    return False


def _summary(value: object) -> object:
    import hashlib

    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return f"<{len(data)} bytes sha256={hashlib.sha256(data).hexdigest()[:16]}>"
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_summary(v) for v in value]
    return value


def pytest_assertrepr_compare(op: str, left: object, right: object) -> list[str] | None:
    """Model bytes are megabytes: pytest's default diff of them runs for minutes (a hung CI run
    was seen). Show sizes and digests instead."""
    if op in ("==", "!=") and (_large(left) or _large(right)):
        return [f"{_summary(left)!r} {op} {_summary(right)!r} (large values shown by size and digest)"]
    return None
