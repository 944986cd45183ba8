"""The transfer engine's per-file state: what to fetch, its chunks, their buffer slots, its hash cursor.

``FileJob`` is one file a pull asks for and ``FetchedFile`` what the engine returns for it.
``FileState`` holds a file while it is fetched: its chunks (``Chunk``), the chunks parked ahead of
its hash cursor, its hasher and writer. ``Slot`` is a chunk's bytes in a pooled buffer, written
and journaled per PIECE and hashed where the cursor is (modelcache/engine/transfer.py runs the workers).
``Slots`` hands out the pooled buffers and spills a parked one when none is free for too long.
``sync_once`` is the durability round: journaled pieces made durable, then the journals marked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modelcache.errors import IntegrityError, ModelcacheError
from modelcache.sources.base import Source
from modelcache.sources.integrity import MultiHasher
from modelcache.sources.remote import Checksum, RemoteFile
from modelcache.store.diskio import ALIGN, BufferPool, FileWriter
from modelcache.store.journal import Journal, JournalState

log = logging.getLogger("modelcache.engine.transfer")

MiB = 1 << 20
PIECE = 4 * MiB  # written and journaled as it arrives: what a kill -9 can lose per chunk
READ_SIZE = 1 * MiB  # at most per read (one recv on the HTTP path), hashed right after it
#: Seconds a worker waits for a free buffer before the parked buffer furthest ahead of its file's
#: hash cursor is spilled (hashed from disk later). Chunks of one file complete at about the same
#: time, so the wait is short when the cursor's stream is healthy; this bounds it when it is not.
SPILL_AFTER = 0.5


@dataclass
class FileJob:
    """One file to fetch: where from, where to, and which journal records it."""

    source: Source
    remote: RemoteFile
    dest: str
    journal: Journal
    index: int  # the file's number in its journal
    group: str  # failures cancel the other files of the same group (one model)
    resume: JournalState = field(default_factory=JournalState)


def progress_key(job: FileJob) -> str:
    """Progress key: unique across the models of one pull (two can both have config.json)."""
    return f"{job.group}\x00{job.remote.path}"


@dataclass(frozen=True)
class FetchedFile:
    path: str  # relative, as listed
    size: int
    xxh3: str
    verified: tuple[str, ...]  # source checksum algorithms the bytes matched
    #: ``time.monotonic()`` when the file was complete (a model of a batch is ready when its last is).
    finished: float = field(default_factory=time.monotonic, compare=False)


@dataclass
class Chunk:
    index: int
    start: int
    end: int
    done: int = 0  # bytes already on disk from the start of the chunk

    @property
    def length(self) -> int:
        return self.end - self.start


def mismatch_cause(expected: Checksum, got: list[str]) -> str:
    """What a checksum that never matched most likely means, from where it came from and what
    each attempt got."""
    if expected.param("from") == "uri":
        return (f"the file does not match the #{expected.algo}= pin written in the URI"
                + (" (the server sent the same bytes every time)" if len(set(got)) == 1 and len(got) > 1 else "")
                + ": check the digest in the URI")
    if len(set(got)) == 1 and len(got) > 1:
        return "the source sent the same bytes every time: the object is corrupt at the source"
    return "the source object is corrupt or changed during download"


class Slot:
    """A chunk's bytes in a pooled buffer, which holds chunk bytes ``base`` to ``base + window``.

    A chunk whose worker owns the file's hash cursor from its start is written and hashed as it
    arrives, so its buffer is reused from the start every PIECE (``window``): eight shards on
    eight streams touch 8 x 4 MiB of buffers instead of 8 x 16 (first touches cost ~1.5 ms per
    MiB in this VM, perf: clear_page and faults). Any other chunk fills its whole buffer, which
    may have to wait (parked) for the cursor.
    """

    __slots__ = ("base", "buf", "chunk", "hashed", "pos", "view", "window", "written")

    def __init__(self, chunk: Chunk, buf: Any) -> None:
        self.chunk = chunk
        self.buf = buf
        self.view = memoryview(buf)[: chunk.length]
        self.base = 0
        self.window = chunk.length
        self.pos = self.written = self.hashed = 0  # chunk offsets: received, on disk, hashed

    def space(self) -> memoryview:
        """Where the next read goes: at most READ_SIZE, never past the chunk or the window."""
        stop = min(self.chunk.length, self.pos + READ_SIZE, self.base + self.window)
        return self.view[self.pos - self.base : stop - self.base]

    def hash_into(self, hasher: MultiHasher) -> None:
        """Hash what arrived since the last call (all of it once the cursor reached the chunk)."""
        assert self.hashed >= self.base, "bytes left the window unhashed"
        if self.pos > self.hashed:
            hasher.update(self.view[self.hashed - self.base : self.pos - self.base])
            self.hashed = self.pos

    def write(self, writer: FileWriter, journal: Journal, index: int) -> None:
        """Write what arrived (aligned for O_DIRECT unless the chunk is complete) and journal it."""
        c = self.chunk
        upto = self.pos if self.pos == c.length else self.pos - self.pos % ALIGN
        writer.write(c.start + self.written, self.view[self.written - self.base : upto - self.base])
        self.written = upto
        journal.chunk(index, c.index, upto)
        if self.window < c.length and self.pos == upto == self.hashed:
            self.base = upto  # written and hashed: the window starts over at the buffer's start


class FileState:
    def __init__(self, job: FileJob, chunk_size: int) -> None:
        self.job = job
        self.lock = threading.Lock()
        self.writer: FileWriter | None = None
        self.size = job.remote.size
        self.streamed = not job.remote.ranged or self.size is None
        self.chunks = self._plan(chunk_size)
        self.pending: list[Chunk] = []
        self.active = 0
        self.chunk_size = chunk_size
        self.cursor = 0  # bytes hashed, in order
        #: The chunk the cursor is in: its worker hashes each read as it arrives (see the module doc).
        self.hash_owner: Chunk | None = self.chunks[0] if self.chunks and not self.streamed else None
        self.waiting: dict[int, tuple[Chunk, Any]] = {}  # chunk start -> (chunk, parked buffer or None: spilled)
        self.hasher: MultiHasher | None = None
        self.attempts = 0
        self.got: list[str] = []  # the digest each attempt that failed its checksum got
        self.result: FetchedFile | None = None
        self.error: BaseException | None = None
        self.lost = False  # a flush of the file failed: its bytes on disk are not trusted

    def _plan(self, chunk_size: int) -> list[Chunk]:
        if self.streamed:
            return [Chunk(0, 0, self.size if self.size is not None else -1)]
        size = self.size or 0
        return [Chunk(i, s, min(s + chunk_size, size)) for i, s in enumerate(range(0, size, chunk_size))]

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def chunk_done(self, slot: Slot, pool: BufferPool, failed: Callable[[], bool]) -> tuple[bool, bool]:
        """A chunk is on disk: hash it if the cursor is in it, else park its buffer. Returns
        (parked, complete): complete once the cursor reached the file's end (check it now)."""
        chunk = slot.chunk
        with self.lock:
            if self.hash_owner is not chunk:
                # A failed model's file is never hashed further: its buffer goes back at once
                # (checked under the lock that TransferEngine._fail takes after marking the model
                # failed). A source that picks its own order (peers) may fill the pool with chunks
                # far ahead: those park only while a buffer is free, so its workers never wait.
                parked = not failed() and (not self.job.source.picks_chunks or pool.available() > 0)
                self.waiting[chunk.start] = (chunk, slot.buf if parked else None)
                return parked, False
        assert self.hasher is not None
        slot.hash_into(self.hasher)
        return False, self.advance(chunk.end, pool)

    def advance(self, cursor: int, pool: BufferPool) -> bool:
        """Move the hash cursor past chunks that completed ahead of it, then hand it to the chunk
        it stops in (whose worker hashes from there as its bytes arrive). Run by the cursor's
        owner only, so the hasher is never touched by two threads and never under a lock. A
        hashed buffer goes back to the pool only after the cursor moved on: the next owner may
        be waiting for it (BufferPool's urgent waiters). True: the whole file is hashed."""
        spent: Any = None
        try:
            while True:
                with self.lock:
                    self.cursor = cursor
                    if self.size is not None and cursor >= self.size:
                        self.hash_owner = None
                        break
                    ahead = self.waiting.pop(cursor, None)
                    self.hash_owner = self.chunks[cursor // self.chunk_size] if ahead is None else ahead[0]
                if spent is not None:
                    pool.release(spent)
                    spent = None
                if ahead is None:
                    return False
                c, held = ahead
                assert self.hasher is not None
                if held is not None:
                    spent = held
                    self.hasher.update(memoryview(held)[: c.length])
                else:
                    self.hash_from_disk(c)
                cursor = c.end
        finally:
            if spent is not None:
                pool.release(spent)
        return True

    def hash_from_disk(self, c: Chunk) -> None:
        """Hash a chunk whose buffer was spilled, read back from the file."""
        assert self.hasher is not None and self.writer is not None
        scratch = bytearray(min(PIECE, max(c.length, 1)))
        view = memoryview(scratch)
        off = c.start
        while off < c.end:
            n = self.writer.read(off, view[: min(len(view), c.end - off)])
            if n == 0:
                raise IntegrityError(f"{self.job.remote.path}: file shorter than expected at byte {off}")
            self.hasher.update(view[:n])
            off += n

    def forget_lost(self) -> bool:
        """Forget a file whose flush failed; True the first time (for one log line per file)."""
        with self.lock:
            first = not self.lost
            self.lost = True
        if first:
            self.job.journal.file_lost(self.job.index)
            # A new file for the next run, not the same inode again: after a failed write-back
            # ext4 can leave the range's extents unwritten on disk while it no longer converts
            # them, so rewriting the same file and fsyncing it (0) still read back as zeros
            # after a remount (seen with tests/test_writeback_error.py). Writers of this run
            # keep their descriptor and fail on their next write.
            with contextlib.suppress(OSError):
                os.unlink(self.job.dest)
        return first


class Slots:
    """A run's chunk buffers (a BufferPool): a slot for each chunk, the waits for a free buffer, and
    which parked buffer to let go (spill) when none comes within SPILL_AFTER."""

    def __init__(self, pool: BufferPool, states: list[FileState], cancel: threading.Event,
                 done: Callable[[], bool], check_cancelled: Callable[[FileState], None]) -> None:
        self.pool, self.states, self.cancel = pool, states, cancel
        self.done, self.check_cancelled = done, check_cancelled

    def slot(self, st: FileState, c: Chunk, writer: FileWriter, buf: Any = None) -> Slot:
        """A slot for the chunk in ``buf`` (else one waited for), holding what an earlier run left on disk."""
        slot = Slot(c, buf if buf is not None else self.acquire(st, c))
        if c.done:
            # On disk from an earlier run: in-order hashing needs it in memory.
            if writer.read(c.start, slot.view[: c.done]) != c.done:
                c.done = 0
            slot.pos = slot.written = c.done
        elif st.hash_owner is c:  # stays ours until the chunk is done: only its owner moves it
            slot.window = PIECE
        return slot

    def free_buffer(self) -> Any:
        """Wait for a buffer (no chunk taken yet); spill a parked one after SPILL_AFTER."""
        waited = 0.0
        while not self.cancel.is_set():
            buf = self.pool.acquire(0.05)
            if buf is not None:
                return buf
            waited += 0.05
            if waited >= SPILL_AFTER:
                self.spill_one()
                waited = 0.0
            if self.done():
                return None
        return None

    def acquire(self, st: FileState, chunk: Chunk) -> Any:
        """A buffer for the next chunk of a run whose last one was parked.

        Only the cursor's owner gives parked buffers back, so once ``chunk`` holds the cursor its
        worker has the first claim on a released buffer (the owner releases the one it hashed
        after handing the cursor on) and spills if none comes; any other waits up to
        SPILL_AFTER for the owner to catch up."""
        def owner() -> bool:
            return st.hash_owner is chunk

        waited = 0.0
        while True:
            buf = self.pool.acquire(0.05, urgent=owner)
            if buf is not None:
                return buf
            self.check_cancelled(st)
            waited += 0.05
            if (owner() and waited >= 0.2) or waited >= SPILL_AFTER:
                self.spill_one()
                waited = 0.0

    def spill_one(self) -> None:
        """Let go of the parked buffer furthest ahead of its file's hash cursor (needed last)."""
        best: tuple[int, FileState, int] | None = None
        for other in self.states:
            with other.lock:
                for start, (_c, held) in other.waiting.items():
                    if held is not None and (best is None or start - other.cursor > best[0]):
                        best = (start - other.cursor, other, start)
        if best is None:
            return
        _, other, start = best
        with other.lock:
            entry = other.waiting.get(start)
            if entry is None or entry[1] is None:
                return  # hashed (or spilled) meanwhile: the pool has a buffer again
            other.waiting[start] = (entry[0], None)
        log.debug("%s: no free buffer for %.1fs; bytes %d+ will be hashed from disk",
                  other.job.remote.path, SPILL_AFTER, start)
        self.pool.release(entry[1])


def sync_once(states: list[FileState]) -> None:
    """One durability round over a run's files: make journaled pieces durable, then mark the journals."""
    # Each journal is marked *before* its files are synced: a piece journaled while they
    # sync may not be in what the sync wrote, and after a reboot a mark is all that says a
    # line's data is on disk. Files of a failed model stay open and are synced too (their
    # chunks are resumed); a finished file was fsynced before its ``F`` line.
    marks: dict[int, tuple[Journal, int]] = {}
    for st in states:
        journal = st.job.journal
        if id(journal) not in marks:
            marks[id(journal)] = (journal, journal.mark())
    synced: set[int] = set()
    failed: set[int] = set()
    for st in states:
        w = st.writer
        if w is None or st.result is not None:
            continue
        try:
            w.datasync()
            synced.add(id(st.job.journal))
        except ModelcacheError as exc:
            # The kernel reports a write-back error once per descriptor: the writer keeps it
            # (its next write or its final fsync raises it) and the journal forgets the
            # file, whose pieces on disk may be zeros. Swallowed here, the final fsync
            # returned 0 and the file was published with holes.
            failed.add(id(st.job.journal))
            if st.forget_lost():
                log.error("%s", exc)
    for jid in synced - failed:
        journal, upto = marks[jid]
        try:
            journal.synced(upto)
        except ModelcacheError:
            pass  # a full disk: the workers report it; a missing mark only costs a refetch
