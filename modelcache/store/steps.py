"""The steps of a publish and of an in-place repair's install, in order.

``reached`` is called at each; crash tests kill the process exactly there (tests/crashpoints.py
replaces it), so every window is tested, not only random moments.
"""

from __future__ import annotations

PUBLISH_STEPS = ("pending", "merging", "swapped", "cleared", "installed")
#: The steps of an in-place repair's install (``NodeStore.install_in_place``), likewise.
REPAIR_STEPS = ("repair-renamed", "repair-installed")


def reached(name: str) -> None:
    """A publish reached step ``name``. Nothing to do: a seam for crash tests."""
