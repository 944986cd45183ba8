"""What a source says about a model's files, and how the engine reads them: the data types the
sources, the transfer engine and integrity share (kept here so none of them imports another).

``RemoteFile`` and ``Checksum`` are plain frozen dataclasses; ``RangeStream`` is the one
protocol of an open ranged read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Checksum:
    """A digest the source vouches for. ``value`` is lower-case hex.

    ``algo`` names a hasher in ``modelcache.sources.integrity`` (sha256, md5, sha1, git-blob-sha1,
    crc32c, s3-etag, ...). ``params`` carries what the hasher needs (e.g. an S3 part size).
    """

    algo: str
    value: str
    params: tuple[tuple[str, str], ...] = ()

    def param(self, name: str, default: str = "") -> str:
        return dict(self.params).get(name, default)


@dataclass(frozen=True)
class RemoteFile:
    """One file of a model, as listed by its source.

    ``path`` is relative, posix, validated (no ``..``, not absolute). ``size`` is None only
    when the backend cannot tell before reading (an HTTP server without Content-Length).
    ``version`` pins what is read (ETag, generation, version id, commit) so a concurrent
    overwrite cannot mix two versions of one file. ``ranged`` is False when the backend can
    only stream the file whole.
    """

    path: str
    size: int | None
    version: str | None = None
    checksums: tuple[Checksum, ...] = ()
    ranged: bool = True
    meta: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def meta_get(self, name: str, default: str = "") -> str:
        return dict(self.meta).get(name, default)


class RangeStream(Protocol):
    """An open ranged read. ``readinto`` returns 0 only at the end of the range.

    ``abort`` is called from another thread (the stall watchdog, a cancel) while a reader may
    be blocked in ``readinto``: it must wake that reader (which then raises or returns 0) and
    release the stream. ``close`` is called by the reader itself; both may be called twice.
    """

    def readinto(self, buf: memoryview, /) -> int: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...
