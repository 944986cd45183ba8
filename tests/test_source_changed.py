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
import threading
import types
from pathlib import Path

import pytest

from modelcache.sources import local as local_mod


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
