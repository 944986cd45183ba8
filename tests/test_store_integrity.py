"""The store's own integrity rules: what the journal trusts, what recover installs, which roots
it locks, and that extracted layouts are durable before their manifests.

Each test failed before the fix beside it (issue 20, points 5, 7, 8 and 12).
"""

from __future__ import annotations

import builtins
import errno
from pathlib import Path
from typing import Any

import pytest

from modelcache import journal as journal_mod
from modelcache.journal import Journal


def _no_boot_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc/sys/kernel/random/boot_id unreadable (a restricted /proc, some sandboxes)."""
    real_open = builtins.open

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file).endswith("kernel/random/boot_id"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(journal_mod, "open", fake_open, raising=False)


def test_unreadable_boot_id_never_makes_unsynced_lines_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point 5: the fallback id "unknown" equalled itself after a reboot, so every unsynced line of
    the last boot was trusted and zeros that never reached the disk were resumed as data."""
    _no_boot_id(monkeypatch)
    j = Journal(str(tmp_path / "journal"))
    j.open(fresh=True)
    j.chunk(0, 0, 4096)
    j.synced()  # covers the first line only
    j.chunk(0, 1, 8192)
    j.file_done(1, "abc", ("sha256",))
    j.close()
    # The next run (after a reboot or not: nothing can tell) trusts what the sync mark covers.
    state = Journal(str(tmp_path / "journal")).load()
    assert state.chunks == {(0, 0): 4096}
    assert state.files == {}


def test_journal_of_an_older_version_with_boot_unknown_is_not_trusted_past_its_marks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_boot_id(monkeypatch)
    p = tmp_path / "journal"
    p.write_text(journal_mod.seal("\nboot unknown\nc 0 0 4096\nS 1\nc 0 1 100\n"))
    assert Journal(str(p)).load().chunks == {(0, 0): 4096}
