"""A RangeStream over a streamed HTTP response body that hands bytes over as they arrive.

``requests``' ``iter_content(n)`` and urllib3's ``read(n)`` block until ``n`` bytes are in;
the transfer engine reads up to 1 MiB at a time and times the first byte to size its
requests, so a blocking read would look like a slow server (and a slow link like a stall).
``read1`` returns what one socket read gives. The length is enforced: a body that ends early
is a TransientError (the engine retries from where it got to), never a silent short file.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable
from typing import Any

from urllib3.exceptions import HTTPError as Urllib3HTTPError

from modelcache.errors import TransientError

_MAX_PIECE = 1 << 20


class ResponseStream:
    def __init__(
        self,
        raw: Any,
        where: str,
        length: int | None,
        skip: int = 0,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """``raw``: a urllib3 response (``requests.Response.raw``); ``length``: bytes promised
        after ``skip`` leading bytes are dropped (a 200 answer to a ranged request)."""
        self._raw = raw
        fp = getattr(raw, "_fp", None)
        coded = str(raw.headers.get("Content-Encoding", "identity")).lower() not in ("", "identity")
        # Straight from http.client when there is no content coding for urllib3 to undo.
        self._fp = fp if isinstance(fp, http.client.HTTPResponse) and not coded else None
        self._where = where
        self._left = length
        self._skip = skip
        self._got = 0
        self._on_close = on_close

    def _read1(self, n: int) -> bytes:
        try:
            if self._fp is not None:
                return self._fp.read1(n)
            return self._raw.read(n) or b""
        except (http.client.HTTPException, Urllib3HTTPError, OSError) as exc:
            raise TransientError(f"{self._where}: connection broken while reading: {type(exc).__name__}") from exc

    def readinto(self, buf: memoryview) -> int:
        while self._skip:
            dropped = self._read1(min(self._skip, _MAX_PIECE))
            if not dropped:
                raise TransientError(f"{self._where}: body ended while skipping to the range start")
            self._skip -= len(dropped)
        if self._left == 0:
            return 0
        want = min(len(buf), _MAX_PIECE, self._left if self._left is not None else len(buf))
        data = self._read1(want)
        if not data:
            if self._left is not None:
                raise TransientError(
                    f"{self._where}: body ended after {self._got} of {self._got + self._left} bytes "
                    "(stream cut, or the file changed)"
                )
            return 0
        n = len(data)
        buf[:n] = data
        self._got += n
        if self._left is not None:
            self._left -= n
        return n

    def abort(self) -> None:
        self.close()

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            try:
                on_close()
            except Exception:
                pass
