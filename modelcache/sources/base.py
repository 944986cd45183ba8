"""The Source interface; ``modelcache.sources.backends`` maps each location kind to its class.

A source knows one backend: how to list a model's files (resolved once to an immutable
revision where the backend has one) and how to read a byte range of one file. It knows
nothing about chunks, retries, disks or checksum verification: the transfer engine does that.
"""

from __future__ import annotations

import posixpath
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from modelcache.errors import InvalidURIError, UnsupportedError
from modelcache.runtime.reserved import META_DIR
from modelcache.sources.backends import BACKENDS, load
from modelcache.sources.remote import Checksum, RangeStream, RemoteFile
from modelcache.sources.uri import Location, parse_uri

if TYPE_CHECKING:
    from modelcache.sources.credentials import Settings

# The shared data types live in modelcache.sources.remote; named here too for a source's one import.
__all__ = ["Checksum", "EmptyStream", "RangeStream", "RemoteFile", "Source", "empty_range",
           "open_source", "safe_relpath", "source_class"]


class EmptyStream:
    """The bytes of an empty range (the one rule: ``start >= end`` is read without a request)."""

    def readinto(self, buf: memoryview, /) -> int:
        return 0

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def empty_range(file: RemoteFile, start: int, end: int | None) -> bool:
    """Whether ``[start, end)`` of ``file`` holds no bytes (``end=None``: to its listed size)."""
    stop = file.size if end is None else end
    return stop is not None and start >= stop


class Source(ABC):
    """Base class of every backend; its line in ``modelcache.sources.backends`` names it.

    Behaviour that differs per backend is a class attribute here, read by the pull and the
    engine, never a list of kinds elsewhere.
    """

    #: Requests the engine keeps open at once against one source of this backend, at most,
    #: whatever --workers / --max-workers say (a registry or a gateway that allows few
    #: connections per client sets it lower). Also the size of the source's connection pool.
    max_streams: int = 32
    #: Whether STORAGE_ALLOW_PATTERNS / STORAGE_IGNORE_PATTERNS filter the listing (KServe
    #: applies them to listings of folders, not to a single HTTP file or an OCI image).
    applies_patterns: bool = True

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

    def distrusted(self, file: RemoteFile) -> str | None:
        """Called with ``check_unchanged``: why the bytes read for ``file`` must not be kept (the
        file is fetched again, as after a checksum mismatch), or None. A source reads its own
        bytes: None. One that passes on other nodes' bytes (``modelcache.peers``) names a node
        whose word some of them were taken on and which it has since found lying."""
        return None

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

    def chunk_run(self, file: RemoteFile, starts: list[int]) -> int:
        """How many of ``starts`` (consecutive chunks of a file, the first one picked) to read as
        one run: all by default (the engine sizes runs by how slow responses are to start). Only
        asked where ``picks_chunks``."""
        return len(starts)

    @property
    def picks_chunks(self) -> bool:
        return type(self).pick_chunk is not Source.pick_chunk

    def before_publish(self, staging_dir: Path) -> None:  # noqa: B027 - optional hook
        """Called once every file is fetched and verified, before the model is published: a
        source may leave a record in ``staging_dir`` that publish installs next to the manifest
        (peer transfer leaves its piece hashes)."""

    @classmethod
    def revision_in(cls, folder: Path) -> str | None:
        """The revision of this source a folder that another tool filled says it holds (the
        tool's own records in it), for adopting the folder at that revision; None: it does not
        say (adoption then lists the source's current one)."""
        return None

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
    if norm.split("/")[0] == META_DIR:  # the store's bookkeeping: never a model's file
        raise InvalidURIError(f"{where}: refusing reserved path {path!r}")
    return norm


def source_class(kind: str) -> type[Source]:
    backend = BACKENDS.get(kind)
    if backend is None:
        raise UnsupportedError(f"storage backend '{kind}' is not supported yet")
    try:
        cls: type[Source] = load(backend.source)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.startswith("modelcache"):
            raise
        raise UnsupportedError(
            f"storage backend '{kind}' needs the Python package '{exc.name}', which is not installed"
        ) from exc
    return cls


def open_source(uri: str | Location, settings: Settings | None = None) -> Source:
    """Parse ``uri`` and build its source with settings from the environment by default."""
    from modelcache.sources.credentials import Settings

    location = parse_uri(uri) if isinstance(uri, str) else uri
    try:
        cls = source_class(location.kind)
        return cls(location, settings if settings is not None else Settings.from_env())
    except UnsupportedError as exc:
        raise UnsupportedError(f"{location.display}: {exc}") from exc
