"""What this node holds of a model it is downloading, as its peer server sees it.

A piece is served once two things are known: its hash (recorded as it passed from the origin,
or verified as it came from a peer) and that the engine wrote its bytes (the engine's resume
journal says so: this object listens to it). Before the first byte of a piece goes out, the
staged file is flushed (``fdatasync``) if it was written since its last flush, so only durable
bytes are served. A file fetched again (a checksum mismatch, a failed write-back) is withdrawn
at once: the epoch changes and peers forget what they were told.

Files are numbered two ways: by their place in the listing (the journal's numbers, ``li``) and
in path order (``ci``, what peers say: their listing may come in another order).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from modelcache.peers.pieces import PieceHash, PieceLog, piece_count, piece_span
from modelcache.peers.protocol import MAX_WAIT, Geometry, HaveReply
from modelcache.sources.base import RemoteFile
from modelcache.store.journal import JournalState


@dataclass(frozen=True)
class ServedRange:
    """Bytes a peer may read: ``[start, end)`` of the file ``rel`` under the folder ``root``
    (opened by ``open_beneath``: nothing outside ``root`` is ever read for a peer)."""

    root: str
    rel: str
    start: int
    end: int
    #: Flushes the file first where it holds bytes written since its last flush (None: durable).
    make_durable: object = None
    #: The file's size as recorded (a published model's manifest): any other size is not served.
    size: int | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.rel)


def open_beneath(root: str, rel: str) -> int:
    """A read-only descriptor of the regular file ``rel`` under ``root``, following no symlink
    on the way (each component is opened with ``O_NOFOLLOW`` from its parent's descriptor): a
    link planted in a model folder cannot make the peer server read another file. OSError if
    anything on the way is a link, missing, or not a regular file."""
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise OSError(errno.EINVAL, f"not a path inside the model: {rel!r}")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        out = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise OSError(errno.EINVAL, f"{rel!r} is not a regular file")
    return out


class LocalPieces:
    def __init__(self, files: list[RemoteFile], data_dir: Path, chunk_size: int, piece_size: int,
                 log: PieceLog, resume: JournalState) -> None:
        self.files = files
        self.data_dir = data_dir
        self.chunk_size = chunk_size
        self.piece_size = piece_size
        self.log = log
        self.sizes = [f.size or 0 for f in files]
        self.by_path = sorted(range(len(files)), key=lambda i: files[i].path)  # ci -> li
        self.canon = {li: ci for ci, li in enumerate(self.by_path)}
        self.total_pieces = sum(piece_count(s, piece_size) for s in self.sizes)
        #: How we cut the model, in the peers' file order: bounds every reply about it.
        self.geometry = Geometry(piece_size, tuple(piece_count(self.sizes[li], piece_size) for li in self.by_path))
        self.cond = threading.Condition()
        self._epoch_base = secrets.token_hex(6)
        self._resets = 0
        self.hashes: dict[tuple[int, int], PieceHash] = log.load()
        self.written: dict[tuple[int, int], float] = {}  # (li, piece) -> when its last byte was written
        self.synced: dict[int, float] = {}  # li -> when its last flush began
        self.served: list[tuple[int, int, str, bool]] = []  # (ci, piece, hex, origin), in the order they came
        self._served_set: set[tuple[int, int]] = set()
        self.fetching: set[tuple[int, int]] = set()  # (li, piece) read from the origin right now
        self._claims_version = 0
        self._sync_locks: dict[int, threading.Lock] = {}
        for li in range(len(files)):
            if li in resume.files:
                self._written_upto(li, self.sizes[li], 0.0)
        for (li, chunk), done in resume.chunks.items():
            if 0 <= li < len(files):
                self._written_upto(li, min(chunk * chunk_size + done, (chunk + 1) * chunk_size), 0.0,
                                   first=chunk * chunk_size)

    @property
    def epoch(self) -> str:
        return f"{self._epoch_base}.{self._resets}"

    # ---- what the download reports -------------------------------------------------------

    def record(self, li: int, piece: int, h: PieceHash) -> None:
        with self.cond:
            self.hashes[(li, piece)] = h
            self.log.add(li, piece, h)
            self._maybe_serve(li, piece)

    def claim(self, li: int, pieces: range) -> None:
        with self.cond:
            self.fetching.update((li, p) for p in pieces)
            self._claims_version += 1
            self.cond.notify_all()

    def unclaim(self, li: int, pieces: range) -> None:
        with self.cond:
            self.fetching.difference_update((li, p) for p in pieces)
            self._claims_version += 1
            self.cond.notify_all()

    def has(self, li: int, piece: int) -> bool:
        with self.cond:
            return (self.canon[li], piece) in self._served_set

    @property
    def complete(self) -> bool:
        with self.cond:
            return len(self._served_set) >= self.total_pieces

    # ---- the journal's events (transfer engine threads) --------------------------------------

    def chunk(self, li: int, chunk: int, done: int) -> None:
        start = chunk * self.chunk_size
        self._written_upto(li, min(start + done, self.sizes[li] if li < len(self.sizes) else 0), time.monotonic(),
                           first=start)

    def file_done(self, li: int) -> None:
        self._written_upto(li, self.sizes[li], time.monotonic())

    def file_reset(self, li: int) -> None:
        """The file is fetched again from its first byte: nothing of it may be served any more."""
        with self.cond:
            ci = self.canon.get(li)
            for key in [k for k in self.hashes if k[0] == li]:
                del self.hashes[key]
            for key in [k for k in self.written if k[0] == li]:
                del self.written[key]
            self.log.reset(li)
            self.served = [s for s in self.served if s[0] != ci]
            self._served_set = {(s[0], s[1]) for s in self.served}
            self._resets += 1
            self.cond.notify_all()

    def _written_upto(self, li: int, upto: int, when: float, first: int = 0) -> None:
        if not 0 <= li < len(self.sizes):
            return
        size = self.sizes[li]
        with self.cond:
            p = first // self.piece_size
            while p < piece_count(size, self.piece_size):
                if piece_span(size, self.piece_size, p)[1] > upto:
                    break
                if (li, p) not in self.written:
                    self.written[(li, p)] = when
                    self._maybe_serve(li, p)
                p += 1

    def _maybe_serve(self, li: int, piece: int) -> None:
        """Caller holds ``cond``."""
        h = self.hashes.get((li, piece))
        key = (self.canon[li], piece)
        if h is None or (li, piece) not in self.written or key in self._served_set:
            return
        self.served.append((key[0], piece, h.hex, h.origin))
        self._served_set.add(key)
        self.cond.notify_all()

    # ---- what the peer server asks -----------------------------------------------------------

    def have(self, epoch: str, since: int, wait: float) -> HaveReply:
        """Everything (a new epoch) or what was added after ``since``; waits up to ``wait`` s
        for news (a new piece, or a change of what is read from the origin)."""
        deadline = time.monotonic() + min(max(0.0, wait), MAX_WAIT)
        with self.cond:
            claims = self._claims_version
            if epoch == self.epoch and 0 <= since <= len(self.served):
                while (len(self.served) == since and self._claims_version == claims and epoch == self.epoch
                       and time.monotonic() < deadline):
                    self.cond.wait(max(0.01, deadline - time.monotonic()))
            full = epoch != self.epoch or not 0 <= since <= len(self.served)
            pieces = self.served if full else self.served[since:]
            fetching = [(self.canon[li], p) for li, p in self.fetching]
            return HaveReply(self.epoch, len(self.served), self.piece_size,
                             len(self._served_set) >= self.total_pieces, full, list(pieces), fetching)

    def range(self, ci: int, start: int, end: int) -> ServedRange | None:
        """The bytes of file ``ci`` in ``[start, end)`` if every piece under them is served."""
        if not 0 <= ci < len(self.by_path):
            return None
        li = self.by_path[ci]
        size = self.sizes[li]
        if not 0 <= start < end <= size:
            return None
        first, last = start // self.piece_size, (end - 1) // self.piece_size
        with self.cond:
            if any((ci, p) not in self._served_set for p in range(first, last + 1)):
                return None
            newest = max(self.written.get((li, p), 0.0) for p in range(first, last + 1))
            fresh = newest > self.synced.get(li, -1.0)
        path = str(self.data_dir / self.files[li].path)
        return ServedRange(str(self.data_dir), self.files[li].path, start, end,
                           (lambda: self._flush(li, path, newest)) if fresh else None)

    def _flush(self, li: int, path: str, newest: float) -> None:
        with self.cond:
            lock = self._sync_locks.setdefault(li, threading.Lock())
        with lock:
            if self.synced.get(li, -1.0) >= newest:
                return  # another request flushed it meanwhile
            began = time.monotonic()
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            with self.cond:
                self.synced[li] = max(self.synced.get(li, -1.0), began)
