"""Loads every fixture module under tests/fixtures/ as a pytest plugin.

Each backend keeps its server fixtures in its own module there, so adding a backend never
edits a shared file.
"""

from __future__ import annotations

from pathlib import Path

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}" for p in (Path(__file__).parent / "fixtures").glob("*.py") if p.stem != "__init__"
)
