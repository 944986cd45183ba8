"""A ranged answer held against the listing: the sources that read over HTTP share these checks.

A server may ignore ``If-Match`` (or a source may have nothing to send it with), so what a
response says about the object is compared with what the listing said: the total size in its
``Content-Range`` and, for a whole-object answer, its ``Content-Length``. A difference means the
object changed between two requests of one download: the file fails with SourceChangedError
(never retried within the run: its listing is pinned) instead of mixing two versions.
"""

from __future__ import annotations

import re

from modelcache.errors import SourceChangedError

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``bytes a-b/total`` as (a, b, total or None for ``*``); None if missing or malformed."""
    m = _CONTENT_RANGE.fullmatch((value or "").strip())
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), None if m.group(3) == "*" else int(m.group(3))


def changed(where: str, what: str) -> SourceChangedError:
    return SourceChangedError(f"{where}: the file changed on the server during the download ({what}); pull again")


def check_total(where: str, content_range: str | None, size: int | None) -> None:
    """A 206's total must be the listed size."""
    parsed = parse_content_range(content_range)
    total = parsed[2] if parsed else None
    if size is not None and total is not None and total != size:
        raise changed(where, f"its size is now {total} bytes, listed {size}")


def check_length(where: str, length: int | None, size: int | None) -> None:
    """A whole-object answer's Content-Length must be the listed size."""
    if size is not None and length is not None and length != size:
        raise changed(where, f"its size is now {length} bytes, listed {size}")
