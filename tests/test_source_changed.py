"""Sources whose bytes change under a download: every response is checked against the listing.

Each test failed before the fix beside it (issue 20, points 2, 3, 4, 9 and 10). The servers are
nginx (tests/fixtures/http.py) with the fault proxy in front of it (tests/faultproxy.py) to make
it behave as servers and caches seen in the wild do: one that drops ``If-Match`` (so it never
answers 412), one with no validators at all (no ETag, no Last-Modified), one whose body is
delimited by closing the connection. The file is replaced in nginx's docroot between two
requests of the same download, at a point the proxy's request hook chooses.
"""

from __future__ import annotations

import os
import subprocess
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from modelcache.credentials import Settings
from modelcache.errors import SourceChangedError, SourceError
from modelcache.pull import pull
from modelcache.sources import local as local_mod
from modelcache.sources.base import RemoteFile
from modelcache.sources.local import LocalSource
from modelcache.store import NodeStore
from modelcache.transfer import TransferOptions
from modelcache.uri import storage_key
from tests.fixtures.http import random_bytes


def test_range_stream_closed_from_two_threads_closes_its_descriptor_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Point 9: the watchdog (or a cancel) and the worker both close a local range stream. Both
    saw the descriptor still open and closed the same number twice; by the second close the
    kernel may have handed that number to a file being written, which then lost its descriptor."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 100)
    stream = local_mod._FileStream(str(f), 0, None)
    closed: list[int] = []
    errors: list[BaseException] = []

    def close_from_the_watchdog() -> None:
        try:
            stream.close()
        except BaseException as exc:
            errors.append(exc)

    def close(fd: int) -> None:
        closed.append(fd)
        if len(closed) == 1:
            # The worker is inside close(), between its check and its bookkeeping: the watchdog
            # closes now.
            other = threading.Thread(target=close_from_the_watchdog)
            other.start()
            other.join(10)
        os.close(fd)

    fake_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    fake_os.close = close
    monkeypatch.setattr(local_mod, "os", fake_os)
    try:
        stream.close()
    except OSError:
        pass  # the old code's second close of the number hit EBADF here
    assert closed == [closed[0]], f"descriptor closed {len(closed)} times"
    assert not errors


# ---- local files (point 4) -------------------------------------------------------------------

MiB = 1 << 20
LOCAL_OPTS = TransferOptions(workers=1, chunk_size=MiB, max_attempts=2, backoff_initial=0.01, backoff_max=0.02)


def _on_nth_open(monkeypatch: pytest.MonkeyPatch, nth: int, action: Callable[[], None]) -> list[int]:
    """Run ``action`` just before the source opens its ``nth`` range (the copy is under way)."""
    real = LocalSource.open_range
    starts: list[int] = []

    def open_range(self: LocalSource, file: RemoteFile, start: int, end: int | None) -> Any:
        starts.append(start)
        if len(starts) == nth:
            action()
        return real(self, file, start, end)

    monkeypatch.setattr(LocalSource, "open_range", open_range)
    return starts


@pytest.mark.parametrize("how", ["in-place", "in-place-mtime-kept", "replaced-mtime-kept"])
def test_local_file_rewritten_during_its_copy_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Its version (mtime and size) was taken from the listing and never looked at again: a file
    rewritten with the same size while it was copied was published half old, half new."""
    old, new = random_bytes(4 * MiB, seed=1), random_bytes(4 * MiB, seed=2)
    src = tmp_path / "src" / "w.bin"
    src.parent.mkdir()
    src.write_bytes(old)
    before = src.stat()

    def rewrite() -> None:
        if how == "replaced-mtime-kept":  # a new file moved over it (a new inode), times copied
            tmp = src.with_name("w.tmp")
            tmp.write_bytes(new)
            os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
            os.replace(tmp, src)
            return
        with open(src, "r+b") as f:
            f.write(new)
        if how == "in-place-mtime-kept":  # the writer puts the mtime back (cp -p, rsync -t)
            os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))

    starts = _on_nth_open(monkeypatch, 3, rewrite)
    root = tmp_path / "root"
    with pytest.raises(SourceChangedError, match=r"'w.bin' changed during the copy"):
        pull(f"file://{src}", root=root, settings=Settings.from_env({}), options=LOCAL_OPTS)
    assert len(starts) >= 3
    assert not NodeStore.at(root).is_present(storage_key(f"file://{src}"))
    # Pulled again, the new file is listed and copied whole.
    monkeypatch.undo()
    res = pull(f"file://{src}", root=root, settings=Settings.from_env({}), options=LOCAL_OPTS)
    assert (res.path / "w.bin").read_bytes() == new


def test_same_size_copy_with_the_mtime_kept_between_two_runs_is_not_resumed_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cp -p`` of a same-size file between a failed run and its resume: the version (mtime and
    size) matched, so the staged chunks of the old file were resumed into the new one."""
    old, new = random_bytes(4 * MiB, seed=3), random_bytes(4 * MiB, seed=4)
    src = tmp_path / "src" / "w.bin"
    src.parent.mkdir()
    src.write_bytes(old)
    before = src.stat()

    def fail() -> None:
        raise SourceError("the source went away (test)")

    _on_nth_open(monkeypatch, 3, fail)
    root = tmp_path / "root"
    uri = f"file://{src}"
    with pytest.raises(SourceError, match="went away"):
        pull(uri, root=root, settings=Settings.from_env({}), options=LOCAL_OPTS)
    monkeypatch.undo()
    other = tmp_path / "other.bin"
    other.write_bytes(new)
    os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
    subprocess.run(["cp", "-p", str(other), str(src)], check=True)  # same inode, same size and mtime
    res = pull(uri, root=root, settings=Settings.from_env({}), options=LOCAL_OPTS)
    assert (res.path / "w.bin").read_bytes() == new
