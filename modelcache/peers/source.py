"""A source that reads each piece from a peer or from the origin, for the transfer engine.

``PeerSource`` wraps the model's own source (the origin): listing, revision, checks and
checksums stay the origin's, so every file is verified against the source's checksums before
publish exactly as without peers. Only ``open_range`` changes: its stream goes piece by piece.

- A piece from a peer is read whole into a buffer and checked against its sha-256 before the
  engine sees a byte of it (the buffer is one piece per stream: what the engine's memory bound
  grows by).
- Pieces read from the origin stream straight through to the engine, hashed on the way; once a
  piece has passed whole, its hash is recorded and, when the engine has written it, served.
  A run of consecutive pieces that are ours to read goes out as one origin request. A read that
  starts inside a piece (the engine's retry after a cut) reads the piece from its start (the
  bytes before are hashed, not passed on), so its hash is still known.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelcache.errors import TransientError
from modelcache.peers.client import Cancel
from modelcache.peers.pieces import PieceHash, piece_span
from modelcache.peers.swarm import SwarmSession
from modelcache.sources.base import RangeStream, RemoteFile, Source


class PeerSource(Source):
    def __init__(self, origin: Source, session: SwarmSession, on_close: Callable[[], None],
                 on_publish: Callable[[Path], None]) -> None:
        super().__init__(origin.location, origin.settings)
        self.origin, self.session = origin, session
        self.max_streams = origin.max_streams  # the engine caps requests per source by it
        self._index = {f.path: i for i, f in enumerate(session.local.files)}
        self._on_close, self._on_publish = on_close, on_publish
        #: Piece buffers of closed streams, for the next ones (never more than were open at once).
        #: A fresh 4 MiB bytearray is a new mapping whose 1,024 pages are faulted in and zeroed
        #: every time: in bench/fleet.py's 16 agents (perf, 2 cores at load 20-50) the zeroing
        #: of new piece buffers was 9.7 % of an agent's CPU.
        self._spare: list[bytearray] = []
        self._spare_lock = threading.Lock()

    def list_files(self) -> list[RemoteFile]:
        return self.origin.list_files()

    def take_buffer(self) -> bytearray:
        """A piece buffer: a closed stream's, else a new one."""
        with self._spare_lock:
            if self._spare:
                return self._spare.pop()
        return bytearray(self.session.local.piece_size)

    def give_back(self, buf: bytearray) -> None:
        """A closed stream's piece buffer (its bytes are overwritten before they are read again:
        a stream reads only what it filled itself)."""
        with self._spare_lock:
            self._spare.append(buf)

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        li = self._index.get(file.path)
        if li is None or not file.ranged or file.size is None:
            return self.origin.open_range(file, start, end)  # streamed whole: nothing to share
        return PieceStream(self, li, file, start, file.size if end is None else min(end, file.size))

    def pick_chunk(self, file: RemoteFile, starts: list[int]) -> int:
        li = self._index.get(file.path)
        if li is None or not file.ranged or file.size is None:
            return 0
        return self.session.pick(li, [s // self.session.local.piece_size for s in starts])

    def chunk_run(self, file: RemoteFile, starts: list[int]) -> int:
        """Pieces we read from the origin in one request (the run ``PieceStream`` reads), else
        one: a piece from a peer is one request whatever the run."""
        li = self._index.get(file.path)
        if li is None or not file.ranged or file.size is None:
            return len(starts)
        psize = self.session.local.piece_size
        n = 1
        if self.session.owns(li, starts[0] // psize):
            while n < len(starts) and self.session.owns(li, starts[n] // psize):
                n += 1
        return n

    def check_unchanged(self, file: RemoteFile) -> None:
        self.origin.check_unchanged(file)

    def distrusted(self, file: RemoteFile) -> str | None:
        li = self._index.get(file.path)
        return self.session.distrusted(li) if li is not None else None

    @property
    def resolved_uri(self) -> str:
        return self.origin.resolved_uri

    @property
    def resolved_revision(self) -> str | None:
        return self.origin.resolved_revision

    def before_publish(self, staging: Path) -> None:
        """Leave the piece record for publish to install, and stop serving the staged copy
        (it is about to move; peers then read the published one)."""
        self._on_publish(staging)
        self._on_close()

    def close(self) -> None:
        with self._spare_lock:
            self._spare.clear()
        try:
            self._on_close()
        finally:
            self.origin.close()


class PieceStream:
    """``[start, end)`` of one file, piece by piece; ``readinto`` as the engine expects."""

    def __init__(self, src: PeerSource, li: int, file: RemoteFile, start: int, end: int) -> None:
        self.src, self.li, self.file = src, li, file
        self.session = src.session
        self.size = file.size or 0
        self.psize = self.session.local.piece_size
        self.pos, self.end = start, end
        self._buf: bytearray | None = None
        self._have = (0, 0)  # file offsets of verified peer bytes in the buffer
        self._origin: RangeStream | None = None
        self._opos = self._oend = 0  # the origin stream's position and end
        self._hasher: Any = None
        self._claimed = range(0)
        self._origin_read = False  # holds one of the swarm's origin reads
        self._stop = threading.Event()
        self._cancel = Cancel()  # cuts a peer read in flight

    def _buffer(self) -> memoryview:
        if self._buf is None:
            self._buf = self.src.take_buffer()
        return memoryview(self._buf)

    def readinto(self, view: memoryview) -> int:
        while self.pos < self.end:
            lo, hi = self._have
            if lo <= self.pos < hi:
                n = min(len(view), hi - self.pos, self.end - self.pos)
                view[:n] = self._buffer()[self.pos - lo : self.pos - lo + n]
                self.pos += n
                self.session.counted_peer(self.li, n)
                return n
            if self._origin is not None and self._opos < self._oend:
                n = self._read_origin(view)
                if n:
                    return n
                continue
            self._close_origin()
            self._next()
        return 0

    def _next(self) -> None:
        """Decide where the piece at ``pos`` comes from (a peer may fill it right here)."""
        piece = self.pos // self.psize
        n = self.session.acquire(self.li, piece, self._buffer(), self._stop, self._cancel)
        if n >= 0:
            start = piece * self.psize
            self._have = (start, start + n)
            return
        self._origin_read = True
        last = piece + 1
        while last * self.psize < self.end and self.session.owns(self.li, last):
            last += 1
        start, _ = piece_span(self.size, self.psize, piece)
        self._oend = min(last * self.psize, self.size)
        self._claimed = range(piece, last)
        self.session.local.claim(self.li, self._claimed)
        self._origin = self.src.origin.open_range(self.file, start, self._oend)
        self._opos = start
        self._hasher = hashlib.sha256()

    def _read_origin(self, view: memoryview) -> int:
        assert self._origin is not None and self._hasher is not None
        piece_end = min((self._opos // self.psize + 1) * self.psize, self._oend)
        if self._opos < self.pos:  # the start of a piece the engine already has: hash, do not pass on
            target = self._buffer()[: min(self.pos, piece_end) - self._opos]
            delivered = False
        else:
            target = view[: min(len(view), piece_end - self._opos, self.end - self.pos)]
            delivered = True
        if self._stop.is_set():
            raise TransientError(f"{self.file.path}: read aborted")
        n = self._origin.readinto(target)
        if n <= 0:
            raise TransientError(f"{self.file.path}: short read at byte {self._opos} (expected up to {self._oend})")
        self._hasher.update(target[:n])
        self.session.counted_origin(n)
        self._opos += n
        if delivered:
            self.pos += n
        if self._opos == piece_end:
            piece = (piece_end - 1) // self.psize
            value = self._hasher.hexdigest()
            self.session.local.record(self.li, piece, PieceHash(value, origin=True))
            self.session.settled(self.li, piece, value)
            self.session.local.unclaim(self.li, range(piece, piece + 1))
            self._claimed = range(piece + 1, self._claimed.stop)
            self._hasher = hashlib.sha256()
            # The run was decided when it began; the swarm may have changed since (a node joined
            # and owns the next piece, or holds it already): stop here rather than read it too.
            if self._opos < self._oend and not self.session.owns(self.li, piece + 1):
                self._close_origin()
        return n if delivered else 0

    def _close_origin(self) -> None:
        if self._origin is not None:
            with contextlib.suppress(Exception):
                self._origin.close()
            self._origin = None
        if self._claimed:
            self.session.local.unclaim(self.li, self._claimed)
            self._claimed = range(0)
        if self._origin_read:
            self._origin_read = False
            self.session.release_origin()

    def abort(self) -> None:
        """The engine's watchdog or a cancel: wake a wait for a peer, cut a peer's or the
        origin's read in flight (its socket is shut down: a blocked read returns at once)."""
        self._stop.set()
        self._cancel.cancel()
        origin = self._origin
        if origin is not None:
            with contextlib.suppress(Exception):
                (getattr(origin, "abort", None) or origin.close)()

    def close(self) -> None:
        """The engine is done with the stream (its worker, after its last ``readinto``)."""
        self._close_origin()
        buf, self._buf, self._have = self._buf, None, (0, 0)
        if buf is not None:
            self.src.give_back(buf)

