"""The Source interface and the registry that maps a location kind to its source class.

A source knows one backend: how to list a model's files (resolved once to an immutable
revision where the backend has one) and how to read a byte range of one file. It knows
nothing about chunks, retries, disks or checksum verification: the transfer engine does that.
"""

from __future__ import annotations

import posixpath
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from modelcache.errors import InvalidURIError, UnsupportedError
from modelcache.uri import Location, parse_uri

if TYPE_CHECKING:
    from modelcache.credentials import Settings


@dataclass(frozen=True)
class Checksum:
    """A digest the source vouches for. ``value`` is lower-case hex.

    ``algo`` names a hasher in ``modelcache.integrity`` (sha256, md5, sha1, git-blob-sha1,
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
    """An open ranged read. ``readinto`` returns 0 only at the end of the range."""

    def readinto(self, buf: memoryview) -> int: ...

    def close(self) -> None: ...


class IterStream:
    """Adapts an iterator of byte chunks (what most SDKs give) to ``readinto``."""

    def __init__(self, chunks: Iterable[bytes], on_close: Callable[[], None] | None = None) -> None:
        self._it: Iterator[bytes] = iter(chunks)
        self._pending = memoryview(b"")
        self._on_close = on_close

    def readinto(self, buf: memoryview) -> int:
        while not self._pending:
            nxt = next(self._it, None)
            if nxt is None:
                return 0
            self._pending = memoryview(nxt)
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


class Source(ABC):
    """Base class of every backend. Subclasses register with ``@register_source(kind)``."""

    #: Chunk size this backend reads best with; the engine may override it.
    preferred_chunk_size: int = 32 << 20
    #: Streams worth opening at once against this backend (the engine adapts within it).
    max_streams: int = 16

    def __init__(self, location: Location, settings: Settings) -> None:
        self.location = location
        self.settings = settings
        self._resolved: str | None = None

    @abstractmethod
    def list_files(self) -> list[RemoteFile]:
        """List the model's files once, pinned to one revision; raise a clear error if none."""

    @abstractmethod
    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        """Open ``[start, end)`` of ``file`` (``end=None``: to the end of the file).

        Errors map to ``modelcache.errors``: TransientError for what a retry may fix.
        """

    def check_unchanged(self, file: RemoteFile) -> None:  # noqa: B027 - optional hook
        """Called once every byte of ``file`` was read, before it counts as fetched: raise
        ``SourceChangedError`` if it may have changed since it was listed in a way its reads
        could not show. Sources pinned to an immutable revision, or whose every response is
        checked against the listed version, need nothing; one with no validator (a local file,
        an HTTP server without ETag or Last-Modified) looks at the file again here.
        """

    def extract_into(self, staging_dir: str, on_bytes: Callable[[int], None]) -> list[str] | None:
        """Hook for layouts that are not one remote object per file (an OCI modelcar image's
        tar layers): write the model tree into ``staging_dir`` directly, call ``on_bytes(n)``
        as bytes arrive, and return the relative paths written. The default, None, means the
        transfer engine fetches ``list_files()`` by ranges, which every other source uses.
        """
        return None

    def pick_chunk(self, file: RemoteFile, starts: list[int]) -> int:
        """Which of a file's next pending chunks (their start offsets, in file order) to read next:
        an index into ``starts``. Only asked where ``picks_chunks`` (peer transfer: the pieces this
        node reads from the origin first, so the origin never waits on the order of the others)."""
        return 0

    @property
    def picks_chunks(self) -> bool:
        return type(self).pick_chunk is not Source.pick_chunk

    def before_publish(self, staging_dir: Path) -> None:  # noqa: B027 - optional hook
        """Called once every file is fetched and verified, before the model is published: a
        source may leave a record in ``staging_dir`` that publish installs next to the manifest
        (peer transfer leaves its piece hashes)."""

    @property
    def extracts_itself(self) -> bool:
        """Whether this source overrides ``extract_into`` (it may still decline per model)."""
        return type(self).extract_into is not Source.extract_into

    @property
    def resolved_uri(self) -> str:
        """The URI pinned to what was listed (commit, digest, version); else the URI as safe to
        print and store (never a SAS token or signature: it lands in plan files and manifests)."""
        return self._resolved or self.location.display

    @property
    def resolved_revision(self) -> str | None:
        return self._resolved

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release pooled connections."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def safe_relpath(path: str, where: str) -> str:
    """Validate a file path from a listing: relative, normalised, inside the model folder."""
    if not path or "\x00" in path or "\\" in path:
        raise InvalidURIError(f"{where}: refusing file name {path!r}")
    norm = posixpath.normpath(path)
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        raise InvalidURIError(f"{where}: refusing file path {path!r} outside the model folder")
    if norm.split("/")[0] == ".modelcache":
        raise InvalidURIError(f"{where}: refusing reserved path {path!r}")
    return norm


_SOURCES: dict[str, type[Source]] = {}


def register_source(kind: str) -> Callable[[type[Source]], type[Source]]:
    def deco(cls: type[Source]) -> type[Source]:
        _SOURCES[kind] = cls
        return cls

    return deco


# Modules imported lazily so one backend's SDK is never loaded for another's URI.
_SOURCE_MODULES = {
    "http": "modelcache.sources.http",
    "local": "modelcache.sources.local",
    "pvc": "modelcache.sources.local",
    "s3": "modelcache.sources.s3",
    "gcs": "modelcache.sources.gcs",
    "azure": "modelcache.sources.azure",
    "hf": "modelcache.sources.hf",
    "oci": "modelcache.sources.oci",
    "hdfs": "modelcache.sources.hdfs",
}


def source_class(kind: str) -> type[Source]:
    if kind not in _SOURCES and kind in _SOURCE_MODULES:
        import importlib

        try:
            importlib.import_module(_SOURCE_MODULES[kind])
        except ModuleNotFoundError as exc:
            if exc.name != _SOURCE_MODULES[kind]:
                raise
    if kind not in _SOURCES:
        raise UnsupportedError(f"storage backend '{kind}' is not supported yet")
    return _SOURCES[kind]


def open_source(uri: str | Location, settings: Settings | None = None) -> Source:
    """Parse ``uri`` and build its source with settings from the environment by default."""
    from modelcache.credentials import Settings

    location = parse_uri(uri) if isinstance(uri, str) else uri
    try:
        cls = source_class(location.kind)
        return cls(location, settings if settings is not None else Settings.from_env())
    except UnsupportedError as exc:
        raise UnsupportedError(f"{location.display}: {exc}") from exc
