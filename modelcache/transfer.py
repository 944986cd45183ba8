"""The transfer engine: parallel ranged reads into preallocated files, verified, resumable.

It knows nothing about backends. Files are cut into chunks (aligned for O_DIRECT); a fixed
pool of workers takes chunks, preferring the file with the fewest workers on it so that with
many shards each worker streams one file in order. A worker reads its chunk into a pooled
buffer, writing pieces to disk as they arrive and journaling them, and retries the rest of the
chunk with backoff on connection errors, 5xx, short reads and stalls.

One pass over the bytes: each file is hashed in order (xxh3-128 plus the source's checksums)
from the buffers the bytes arrived in, never read back from disk on the normal path. The worker
whose chunk holds the file's hash cursor hashes each read as it lands, spreading the hashing
over the workers instead of one thread at a chunk's end; a chunk that completes ahead of the
cursor keeps (parks) its buffer until the cursor reaches it, and its worker takes another buffer
for its next chunk. No lock is held while hashing: the cursor's owner alone touches the hasher.
Memory is bounded by (workers + spares) x chunk size: a worker that finds no free buffer waits
for the cursor to catch up; only after SPILL_AFTER seconds (a stalled cursor chunk) is the
parked buffer furthest ahead let go, its chunk hashed from disk when its turn comes. A source
that picks its own chunk order (peers) parks only while a buffer is free and spills otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tenacity import Retrying

from modelcache.diskio import ALIGN, BufferPool, FileWriter, direct_io_supported
from modelcache.errors import CancelledError, IntegrityError, ModelcacheError, RateLimitedError, TransientError
from modelcache.integrity import MultiHasher
from modelcache.journal import Journal, JournalState
from modelcache.progress import ProgressTracker, human_bytes, plural
from modelcache.remote import Checksum, RangeStream, RemoteFile
from modelcache.resources import ResourceError
from modelcache.sources.base import Source
from modelcache.transfer_control import SourceStats, StreamLimit, Watchdog, retry_policy

log = logging.getLogger(__name__)

MiB = 1 << 20
PIECE = 4 * MiB  # written and journaled as it arrives: what a kill -9 can lose per chunk
READ_SIZE = 1 * MiB  # at most per read (one recv on the HTTP path), hashed right after it
#: Seconds a worker waits for a free buffer before the parked buffer furthest ahead of its file's
#: hash cursor is spilled (hashed from disk later). Chunks of one file complete at about the same
#: time, so the wait is short when the cursor's stream is healthy; this bounds it when it is not.
SPILL_AFTER = 0.5
#: Pending chunks of a file a source that picks its own order (peer transfer) chooses among.
PICK_WINDOW = 64


@dataclass(frozen=True)
class TransferOptions:
    workers: int = 8  # streams at the start (and at most, unless max_workers is higher)
    #: 8 MiB: a single big file on 8 streams touches (8 + spares) x chunk of buffers (16 MiB chunks
    #: took a 1 GiB pull to 226 MiB RSS); no more CPU per GiB than 16 MiB (1.21 against 1.33
    #: CPU-s for 1 GiB, same sitting), and it is the part size S3 clients use.
    chunk_size: int = 8 * MiB
    spare_buffers: int | None = None  # default: workers // 2
    max_attempts: int = 6
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    stall_timeout: float = 30.0
    direct_io: bool | None = None  # None: use O_DIRECT where the file system accepts it
    integrity_retries: int = 2  # re-fetches of a file whose bytes did not match its checksum
    sync_interval: float = 2.0  # seconds between fdatasyncs of the files in flight (journal marks)
    #: Grow up to this many streams while throughput grows (StreamLimit); None: fixed ``workers``.
    max_workers: int | None = None
    adapt_interval: float = 1.0

    def normalized(self) -> TransferOptions:
        chunk = max(ALIGN, self.chunk_size - self.chunk_size % ALIGN)
        return TransferOptions(
            workers=max(1, self.workers),
            chunk_size=chunk,
            spare_buffers=self.spare_buffers if self.spare_buffers is not None else max(1, self.workers // 2),
            max_attempts=max(1, self.max_attempts),
            backoff_initial=self.backoff_initial,
            backoff_max=self.backoff_max,
            stall_timeout=self.stall_timeout,
            direct_io=self.direct_io,
            integrity_retries=self.integrity_retries,
            sync_interval=max(0.01, self.sync_interval),
            max_workers=max(max(1, self.workers), self.max_workers or 0),
            adapt_interval=max(0.05, self.adapt_interval),
        )


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


def _pkey(job: FileJob) -> str:
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
class _Chunk:
    index: int
    start: int
    end: int
    done: int = 0  # bytes already on disk from the start of the chunk

    @property
    def length(self) -> int:
        return self.end - self.start


def _mismatch_cause(expected: Checksum, got: list[str]) -> str:
    """What a checksum that never matched most likely means, from where it came from and what
    each attempt got."""
    if expected.param("from") == "uri":
        return (f"the file does not match the #{expected.algo}= pin written in the URI"
                + (" (the server sent the same bytes every time)" if len(set(got)) == 1 and len(got) > 1 else "")
                + ": check the digest in the URI")
    if len(set(got)) == 1 and len(got) > 1:
        return "the source sent the same bytes every time: the object is corrupt at the source"
    return "the source object is corrupt or changed during download"


class _Slot:
    """A chunk's bytes in a pooled buffer, which holds chunk bytes ``base`` to ``base + window``.

    A chunk whose worker owns the file's hash cursor from its start is written and hashed as it
    arrives, so its buffer is reused from the start every PIECE (``window``): eight shards on
    eight streams touch 8 x 4 MiB of buffers instead of 8 x 16 (first touches cost ~1.5 ms per
    MiB in this VM, perf: clear_page and faults). Any other chunk fills its whole buffer, which
    may have to wait (parked) for the cursor.
    """

    __slots__ = ("base", "buf", "chunk", "hashed", "pos", "view", "window", "written")

    def __init__(self, chunk: _Chunk, buf: Any) -> None:
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


class _FileState:
    def __init__(self, job: FileJob, chunk_size: int) -> None:
        self.job = job
        self.lock = threading.Lock()
        self.writer: FileWriter | None = None
        self.size = job.remote.size
        self.streamed = not job.remote.ranged or self.size is None
        self.chunks = self._plan(chunk_size)
        self.pending: list[_Chunk] = []
        self.active = 0
        self.chunk_size = chunk_size
        self.cursor = 0  # bytes hashed, in order
        #: The chunk the cursor is in: its worker hashes each read as it arrives (see the module doc).
        self.hash_owner: _Chunk | None = self.chunks[0] if self.chunks and not self.streamed else None
        self.waiting: dict[int, tuple[_Chunk, Any]] = {}  # chunk start -> (chunk, parked buffer or None: spilled)
        self.hasher: MultiHasher | None = None
        self.attempts = 0
        self.got: list[str] = []  # the digest each attempt that failed its checksum got
        self.result: FetchedFile | None = None
        self.error: BaseException | None = None
        self.lost = False  # a flush of the file failed: its bytes on disk are not trusted

    def _plan(self, chunk_size: int) -> list[_Chunk]:
        if self.streamed:
            return [_Chunk(0, 0, self.size if self.size is not None else -1)]
        size = self.size or 0
        return [_Chunk(i, s, min(s + chunk_size, size)) for i, s in enumerate(range(0, size, chunk_size))]

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None


class TransferEngine:
    def __init__(self, options: TransferOptions | None = None, progress: ProgressTracker | None = None) -> None:
        self.options = (options or TransferOptions()).normalized()
        self.progress = progress or ProgressTracker()
        self._cond = threading.Condition()
        self._states: list[_FileState] = []
        self._failed_groups: dict[str, BaseException] = {}
        self._direct: dict[str, bool] = {}
        self._cancel = threading.Event()
        self._source_stats: dict[int, SourceStats] = {}
        self._busy = 0  # workers holding a request
        self._source_busy: dict[int, int] = {}  # id(source) -> workers holding a request to it
        self._limit = StreamLimit(self.options.workers, self.options.max_workers or self.options.workers)
        self.peak_streams = self.options.workers
        #: Per model (group): monotonic time of its first request and of its last byte on disk.
        self.windows: dict[str, list[float]] = {}

    def cancel(self) -> None:
        self._cancel.set()
        with self._cond:
            self._cond.notify_all()
        # A worker blocked in a read (a stalled server, a long run of chunks) would otherwise
        # only notice at its next request: up to the stall timeout, or a whole file, later.
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.abort_all()

    def _check_cancelled(self, st: _FileState) -> None:
        """Stop fetching for a cancelled run or a model that already failed (not retried)."""
        if self._cancel.is_set():
            raise CancelledError(f"{st.job.remote.path}: download cancelled (staged data kept for a resume)")
        failed = self._failed_groups.get(st.job.group)
        if failed is not None:
            raise ModelcacheError(f"{st.job.remote.path}: stopped: another file of the model failed ({failed})")

    # ---- public entry point -------------------------------------------------------------

    def run(self, jobs: list[FileJob]) -> tuple[dict[str, list[FetchedFile]], dict[str, BaseException]]:
        """Fetch every job; returns per-group results and per-group errors."""
        opts = self.options
        self._states = [_FileState(j, opts.chunk_size) for j in jobs]
        for st in self._states:
            self._prepare(st)
        streams = opts.max_workers or opts.workers
        # Buffers are mmapped lazily: ones for streams never started cost address space only.
        try:
            pool = BufferPool(streams + (opts.spare_buffers or 0), opts.chunk_size)
        except (OSError, MemoryError, OverflowError) as exc:
            count = streams + (opts.spare_buffers or 0)
            raise ResourceError(
                f"cannot allocate {count} transfer buffers of {human_bytes(opts.chunk_size)} "
                f"({getattr(exc, 'strerror', None) or type(exc).__name__}); lower the chunk size or the workers"
            ) from None
        self._pool = pool
        self._watchdog = Watchdog(opts.stall_timeout)
        syncer_stop = threading.Event()
        syncer = threading.Thread(target=self._sync_loop, args=(syncer_stop,), name="modelcache-sync", daemon=True)
        syncer.start()
        workers = [
            threading.Thread(target=self._worker, name=f"modelcache-worker-{i}", daemon=True)
            for i in range(streams)
        ]
        adapter_stop = threading.Event()
        if streams > opts.workers:
            threading.Thread(target=self._adapt_loop, args=(adapter_stop,), name="modelcache-adapt",
                             daemon=True).start()
        try:
            try:
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
            except BaseException:
                # Ctrl-C in the calling thread: stop the workers before their files are closed
                # below, or they go on fetching and write into descriptors closed under them
                # (and reused by the files they open next).
                self.cancel()
                for w in workers:
                    if w.ident is not None:
                        w.join()
                raise
        finally:
            adapter_stop.set()
            syncer_stop.set()
            syncer.join()
            # Files left unfinished (a failed or cancelled run) are flushed once more: a
            # write-back error since the last round must reach their journal before a resume
            # trusts its lines.
            self._sync_once()
            self._watchdog.stop()
            for st in self._states:
                if st.writer is not None:
                    st.writer.close()
            pool.close()
        for st in self._states:  # cancelled before it finished: never a partial result
            if not st.finished and st.job.group not in self._failed_groups:
                self._failed_groups[st.job.group] = CancelledError(
                    f"{st.job.remote.path}: download cancelled (staged data kept for a resume)")
        results: dict[str, list[FetchedFile]] = {}
        for st in self._states:
            if st.result is not None and st.job.group not in self._failed_groups:
                results.setdefault(st.job.group, []).append(st.result)
        return results, dict(self._failed_groups)

    def _mark(self, st: _FileState, start: bool = False) -> None:
        now = time.monotonic()
        window = self.windows.setdefault(st.job.group, [now, now])  # (dict ops are atomic under the GIL)
        if start:
            window[0] = min(window[0], now)
        else:
            window[1] = max(window[1], now)

    def transfer_seconds(self, group: str) -> float:
        """From a model's first request to its last byte written (0 if nothing was fetched)."""
        first, last = self.windows.get(group, (0.0, 0.0))
        return max(0.0, last - first)

    # ---- planning -----------------------------------------------------------------------

    def _prepare(self, st: _FileState) -> None:
        job = st.job
        done = job.resume.files.get(job.index)
        if done is not None and os.path.exists(job.dest) and (st.size is None or os.path.getsize(job.dest) == st.size):
            size = os.path.getsize(job.dest)
            st.result = FetchedFile(job.remote.path, size, done[0], done[1])
            self.progress.add_total(size, 1)
            self.progress.skip(size)
            self.progress.file_finished(_pkey(job))
            return
        already = 0
        if not st.streamed:
            for c in st.chunks:
                c.done = min(job.resume.chunks.get((job.index, c.index), 0), c.length)
                already += c.done
        if already and not os.path.exists(job.dest):
            for c in st.chunks:
                c.done = 0
            already = 0
        self.progress.add_total(st.size or 0, 1)
        self.progress.skip(already)
        # Chunks already on disk go through the workers too: they are read back, not fetched,
        # so the file is hashed in order exactly as on a fresh run.
        st.pending = list(st.chunks)
        if not st.chunks:  # zero bytes: nothing to fetch, only to create and check
            try:
                self._finish_file(st)
            except BaseException as exc:
                self._fail(st, exc)

    def _open_writer(self, st: _FileState) -> FileWriter:
        if st.writer is None:
            d = os.path.dirname(st.job.dest)
            os.makedirs(d, exist_ok=True)
            if d not in self._direct:
                want = self.options.direct_io
                self._direct[d] = direct_io_supported(d) if want is None else want
            st.writer = FileWriter(st.job.dest, st.size, self._direct[d])
            st.hasher = MultiHasher(st.job.remote.checksums, st.size)
            self.progress.file_started(_pkey(st.job), st.size, sum(c.done for c in st.chunks),
                                       resumable=not st.streamed)
        return st.writer

    # ---- scheduling ---------------------------------------------------------------------

    def _next(self) -> tuple[_FileState, list[_Chunk], Any] | None:
        """The next request: a run of consecutive fresh chunks of the least-served file, and the
        buffer for its first chunk.

        The buffer is taken before the chunk: a chunk handed out in file order then always has
        one, so the cursor's chunk never waits for buffers that chunks after it hold parked
        (only the cursor's owner gives those back)."""
        buf: Any = None
        try:
            while True:
                with self._cond:
                    task = self._take(buf)
                    if task == "done":
                        return None
                    if task is not None:
                        buf = None  # handed out with the task
                        return task
                buf = self._free_buffer()
                if buf is None:
                    return None
        finally:
            if buf is not None:
                self._pool.release(buf)

    def _take(self, buf: Any) -> tuple[_FileState, list[_Chunk], Any] | Literal["done"] | None:
        """Under the engine's lock: a task, "done", or None (a chunk is waiting for a buffer)."""
        while True:
            if self._cancel.is_set():
                return "done"
            if self._busy >= self._limit.limit:  # more threads than allowed streams: wait
                if all(st.finished or st.job.group in self._failed_groups for st in self._states):
                    return "done"
                self._cond.wait(0.5)
                continue
            best: _FileState | None = None
            for st in self._states:
                runnable = st.pending and not st.finished and st.job.group not in self._failed_groups
                # A source's max_streams caps the requests open against it at once.
                room = self._source_busy.get(id(st.job.source), 0) < st.job.source.max_streams
                if runnable and room and (best is None or st.active < best.active):
                    best = st
            if best is not None:
                if buf is None:
                    buf = self._pool.acquire(0)
                    if buf is None:
                        return None
                best.active += 1
                self._busy += 1
                sid = id(best.job.source)
                self._source_busy[sid] = self._source_busy.get(sid, 0) + 1
                first = 0
                if not best.streamed and best.job.source.picks_chunks:
                    window = [c.start for c in best.pending[:PICK_WINDOW]]
                    first = min(max(0, best.job.source.pick_chunk(best.job.remote, window)), len(window) - 1)
                run = [best.pending.pop(first)]
                if not best.streamed and run[0].done == 0 and (first == 0 or best.job.source.picks_chunks):
                    limit = self._stats(best.job.source).run_length
                    nxt = first
                    while (len(run) < limit and nxt < len(best.pending) and best.pending[nxt].done == 0
                           and best.pending[nxt].start == run[-1].end):
                        run.append(best.pending[nxt])
                        nxt += 1
                    if best.job.source.picks_chunks:
                        # Peer transfer: a run is only what goes to the origin as one request
                        # (waits for peers would otherwise count as a slow server and grow runs
                        # into whole files, one piece at a time: bench/swarm_sim.py, 4.9x -> 1.03x).
                        run = run[: max(1, best.job.source.chunk_run(best.job.remote, [c.start for c in run]))]
                    del best.pending[first: first + len(run) - 1]  # the chunks after the first, taken
                return best, run, buf
            if all(st.finished or st.job.group in self._failed_groups for st in self._states):
                return "done"
            self._cond.wait(0.5)

    def _adapt_loop(self, stop: threading.Event) -> None:
        """Every ``adapt_interval``: feed the throughput to the stream limit (hill climb)."""
        last_bytes = self.progress.snapshot().bytes_done
        last_t = time.monotonic()
        while not stop.wait(self.options.adapt_interval):
            now = time.monotonic()
            done = self.progress.snapshot().bytes_done
            rate = (done - last_bytes) / max(now - last_t, 1e-3)
            last_bytes, last_t = done, now
            with self._cond:
                saturated = self._busy >= self._limit.limit
                before = self._limit.limit
                limit = self._limit.observe(rate, saturated)
                self.peak_streams = max(self.peak_streams, limit)
                if limit != before:
                    log.debug("streams %d -> %d at %.0f MB/s", before, limit, rate / 1e6)
                    self._cond.notify_all()

    def _stats(self, source: Source) -> SourceStats:
        stats = self._source_stats.get(id(source))
        if stats is None:
            stats = self._source_stats[id(source)] = SourceStats(self.options.chunk_size)
        return stats

    def _worker(self) -> None:
        while True:
            task = self._next()
            if task is None:
                return
            st, run, buf = task
            try:
                with st.lock:
                    writer = self._open_writer(st)
                if st.streamed:
                    try:
                        self._fetch_stream(st, writer, buf)
                    finally:
                        self._pool.release(buf)
                else:
                    self._fetch_run(st, run, writer, buf)
            except BaseException as exc:
                self._fail(st, exc)
            finally:
                with self._cond:
                    st.active -= 1
                    self._busy -= 1
                    self._source_busy[id(st.job.source)] -= 1
                    self._cond.notify_all()

    def _fail(self, st: _FileState, exc: BaseException) -> None:
        with self._cond:
            st.error = exc
            self._failed_groups.setdefault(st.job.group, exc)
            self._cond.notify_all()
        # Buffers parked for the failed model's in-order hashing go back to the pool, or the
        # models still running would lose them.
        for other in self._states:
            if other.job.group != st.job.group:
                continue
            with other.lock:
                held = [(start, c, b) for start, (c, b) in other.waiting.items() if b is not None]
                for start, c, _ in held:
                    other.waiting[start] = (c, None)
            for _, _, b in held:
                self._pool.release(b)

    # ---- buffers ------------------------------------------------------------------------

    def _free_buffer(self) -> Any:
        """Wait for a buffer (no chunk taken yet); spill a parked one after SPILL_AFTER."""
        waited = 0.0
        while not self._cancel.is_set():
            buf = self._pool.acquire(0.05)
            if buf is not None:
                return buf
            waited += 0.05
            if waited >= SPILL_AFTER:
                self._spill_one()
                waited = 0.0
            if all(st.finished or st.job.group in self._failed_groups for st in self._states):
                return None
        return None

    def _acquire(self, st: _FileState, chunk: _Chunk) -> Any:
        """A buffer for the next chunk of a run whose last one was parked.

        Only the cursor's owner gives parked buffers back, so once ``chunk`` holds the cursor its
        worker has the first claim on a released buffer (the owner releases the one it hashed
        after handing the cursor on) and spills if none comes; any other waits up to
        SPILL_AFTER for the owner to catch up."""
        def owner() -> bool:
            return st.hash_owner is chunk

        waited = 0.0
        while True:
            buf = self._pool.acquire(0.05, urgent=owner)
            if buf is not None:
                return buf
            self._check_cancelled(st)
            waited += 0.05
            if (owner() and waited >= 0.2) or waited >= SPILL_AFTER:
                self._spill_one()
                waited = 0.0

    def _spill_one(self) -> None:
        """Let go of the parked buffer furthest ahead of its file's hash cursor (needed last)."""
        best: tuple[int, _FileState, int] | None = None
        for other in self._states:
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
        self._pool.release(entry[1])

    # ---- fetching -----------------------------------------------------------------------

    def _retrying(self, what: str, position: Callable[[], int] | None = None) -> Retrying:
        opts = self.options
        # Backoff sleeps end early on cancel (the next attempt then stops at its first check).
        return retry_policy(what, opts.max_attempts, opts.backoff_initial, opts.backoff_max,
                            position=position, sleep=self._cancel.wait, on_retry=self._on_retry)

    def _on_retry(self, exc: BaseException | None) -> None:
        # A server that says "too many requests" gets fewer streams (only when adapting: a
        # fixed --workers is what the user asked for).
        if isinstance(exc, RateLimitedError) and (self.options.max_workers or 0) > self.options.workers:
            with self._cond:
                self._limit.backoff()

    def _stalled(self, path: str) -> TransientError:
        return TransientError(f"{path}: no data for {self.options.stall_timeout:.0f}s (stalled; a slow link may "
                              "need a larger --stall-timeout)")

    def _read_into(self, st: _FileState, stream: RangeStream, view: memoryview, entry: list[Any]) -> int:
        path = st.job.remote.path
        self._check_cancelled(st)
        try:
            n = stream.readinto(view)
        except Exception as exc:
            self._check_cancelled(st)  # the read failed because cancel() aborted the stream
            if isinstance(exc, ModelcacheError):
                raise
            if entry[2]:
                raise self._stalled(path) from exc
            if isinstance(exc, OSError):
                raise TransientError(f"{path}: connection error: {exc}") from exc
            raise
        self._check_cancelled(st)  # an aborted stream may also just end early
        if entry[2]:
            raise self._stalled(path)
        entry[1] = time.monotonic()
        return n

    def _begin(self, st: _FileState, c: _Chunk, writer: FileWriter, buf: Any = None) -> _Slot:
        slot = _Slot(c, buf if buf is not None else self._acquire(st, c))
        if c.done:
            # On disk from an earlier run: in-order hashing needs it in memory.
            if writer.read(c.start, slot.view[: c.done]) != c.done:
                c.done = 0
            slot.pos = slot.written = c.done
        elif st.hash_owner is c:  # stays ours until the chunk is done: only its owner moves it
            slot.window = PIECE
        return slot

    def _fetch_run(self, st: _FileState, run: list[_Chunk], writer: FileWriter, buf: Any) -> None:
        """Fetch consecutive chunks through as few requests as possible, one buffer per chunk
        (``buf`` for the first; one hashed at once is reused for the next).

        Bytes already in a buffer survive a failed attempt: the retry asks only for the rest.
        """
        path = st.job.remote.path
        key = _pkey(st.job)
        stats = self._stats(st.job.source)
        end = run[-1].end
        i = 0
        slot: _Slot | None = None
        stream: RangeStream | None = None
        entry: list[Any] = []
        opened = first_byte = 0.0
        got = 0

        def close_stream() -> None:
            nonlocal stream
            if stream is not None:
                self._watchdog.unwatch(entry)
                stream.close()
                stream = None

        def position() -> int:
            return run[i].start + (slot.pos if slot is not None else 0) if i < len(run) else end

        try:
            slot = self._begin(st, run[0], writer, buf)
        except BaseException:
            self._pool.release(buf)
            raise
        try:
            for attempt in self._retrying(f"{path} bytes {run[0].start}-{end}", position):
                with attempt:
                    try:
                        while i < len(run):
                            c = run[i]
                            assert slot is not None
                            if slot.pos < c.length and stream is None:
                                self._check_cancelled(st)
                                opened = time.monotonic()
                                self._mark(st, start=True)
                                stream = st.job.source.open_range(st.job.remote, c.start + slot.pos, end)
                                entry = self._watchdog.watch(stream)
                                first_byte = 0.0
                                got = 0
                            while slot.pos < c.length:
                                assert stream is not None
                                n = self._read_into(st, stream, slot.space(), entry)
                                if n == 0:
                                    raise TransientError(
                                        f"{path}: short read at byte {c.start + slot.pos} (expected up to {end})"
                                    )
                                if not got:
                                    first_byte = time.monotonic()
                                got += n
                                slot.pos += n
                                if st.hash_owner is c:  # the cursor is here: hash while in cache
                                    assert st.hasher is not None
                                    slot.hash_into(st.hasher)
                                self.progress.advance(key, n)
                                if slot.pos - slot.written >= PIECE and slot.pos < c.length:
                                    slot.write(writer, st.job.journal, st.job.index)
                            if slot.written < c.length:
                                slot.write(writer, st.job.journal, st.job.index)
                            c.done = c.length
                            self._mark(st)
                            # The buffer goes back to the pool unless it was parked, also when
                            # completing the chunk raises (a final checksum mismatch, a failed
                            # fsync): a leaked buffer shrinks the pool for the rest of the run,
                            # and once spares + 1 are lost a worker waits for buffers for ever.
                            done, slot, parked = slot, None, False
                            reuse = None
                            try:
                                parked = self._chunk_done(st, done)
                                if not parked and i + 1 < len(run):
                                    reuse = done.buf
                            finally:
                                if not parked and reuse is None:
                                    self._pool.release(done.buf)
                            i += 1
                            if i < len(run):
                                slot = self._begin(st, run[i], writer, reuse)
                        if stream is not None and got:
                            stats.observe(first_byte - opened, got, time.monotonic() - first_byte)
                    finally:
                        close_stream()
        finally:
            if slot is not None:
                self._pool.release(slot.buf)

    def _fetch_stream(self, st: _FileState, writer: FileWriter, buf: Any) -> None:
        """A file the backend cannot range: one sequential stream, hashed inline, restarted on error."""
        view = memoryview(buf)
        path = st.job.remote.path
        for _ in range(self.options.integrity_retries + 1):
            total = 0
            for attempt in self._retrying(path):
                with attempt:
                    self.progress.rewind(_pkey(st.job), total)
                    total = 0
                    st.hasher = MultiHasher(st.job.remote.checksums, st.size)
                    self._check_cancelled(st)
                    self._mark(st, start=True)
                    stream = st.job.source.open_range(st.job.remote, 0, None)
                    entry = self._watchdog.watch(stream)
                    try:
                        while True:
                            fill = 0
                            while fill < len(view):
                                n = self._read_into(st, stream, view[fill : fill + READ_SIZE], entry)
                                if n == 0:
                                    break
                                st.hasher.update(view[fill : fill + n])  # while in cache
                                fill += n
                                self.progress.advance(_pkey(st.job), n)
                            if fill:
                                writer.write(total, view[:fill])
                                total += fill
                            if fill < len(view):
                                break
                    finally:
                        self._watchdog.unwatch(entry)
                        stream.close()
                    if st.size is not None and total != st.size:
                        raise TransientError(f"{path}: got {total} bytes, expected {st.size} (truncated)")
            writer.truncate(total)
            self._mark(st)
            if st.size is None:
                st.size = total
                self.progress.add_total(total)
            if self._finish_file(st):
                return
            self.progress.rewind(_pkey(st.job), total)

    # ---- in-order hashing and completion ------------------------------------------------

    def _chunk_done(self, st: _FileState, slot: _Slot) -> bool:
        """A chunk is on disk: hash it if the cursor is in it, else park its buffer (True)."""
        chunk = slot.chunk
        with st.lock:
            if st.hash_owner is not chunk:
                # A failed model's file is never hashed further: its buffer goes back at once
                # (checked under the lock that _fail takes after marking the model failed). A
                # source that picks its own order (peers) may fill the pool with chunks far
                # ahead: those park only while a buffer is free, so its workers never wait.
                parked = st.job.group not in self._failed_groups and (
                    not st.job.source.picks_chunks or self._pool.available() > 0)
                st.waiting[chunk.start] = (chunk, slot.buf if parked else None)
                return parked
        assert st.hasher is not None
        slot.hash_into(st.hasher)
        self._advance(st, chunk.end)
        return False

    def _advance(self, st: _FileState, cursor: int) -> None:
        """Move the hash cursor past chunks that completed ahead of it, then hand it to the chunk
        it stops in (whose worker hashes from there as its bytes arrive). Run by the cursor's
        owner only, so the hasher is never touched by two threads and never under a lock. A
        hashed buffer goes back to the pool only after the cursor moved on: the next owner may
        be waiting for it (BufferPool's urgent waiters)."""
        spent: Any = None
        try:
            while True:
                with st.lock:
                    st.cursor = cursor
                    if st.size is not None and cursor >= st.size:
                        st.hash_owner = None
                        break
                    ahead = st.waiting.pop(cursor, None)
                    st.hash_owner = st.chunks[cursor // st.chunk_size] if ahead is None else ahead[0]
                if spent is not None:
                    self._pool.release(spent)
                    spent = None
                if ahead is None:
                    return
                c, held = ahead
                assert st.hasher is not None
                if held is not None:
                    spent = held
                    st.hasher.update(memoryview(held)[: c.length])
                else:
                    self._hash_from_disk(st, c)
                cursor = c.end
        finally:
            if spent is not None:
                self._pool.release(spent)
        self._finish_file(st)

    def _hash_from_disk(self, st: _FileState, c: _Chunk) -> None:
        assert st.hasher is not None and st.writer is not None
        scratch = bytearray(min(PIECE, max(c.length, 1)))
        view = memoryview(scratch)
        off = c.start
        while off < c.end:
            n = st.writer.read(off, view[: min(len(view), c.end - off)])
            if n == 0:
                raise IntegrityError(f"{st.job.remote.path}: file shorter than expected at byte {off}")
            st.hasher.update(view[:n])
            off += n

    def _finish_file(self, st: _FileState) -> bool:
        """Check the file's checksums; publish its result, or queue it again (False)."""
        job = st.job
        path = job.remote.path
        if st.writer is None:
            self._open_writer(st)
        assert st.writer is not None and st.hasher is not None
        # Before the checksums: a file that changed under the download is not fetched again
        # within this run (its listing, size and version are pinned); the next pull lists it anew.
        job.source.check_unchanged(job.remote)
        bad = st.hasher.mismatches()
        # Bytes taken on the word of a peer since found lying (peer transfer): as a mismatch.
        distrust = None if bad else job.source.distrusted(job.remote)
        if bad or distrust:
            st.attempts += 1
            # A ranged file without chunks (zero bytes) has nothing to fetch again: queueing
            # it would leave it neither finished nor failed, and the workers waiting for ever.
            nothing_to_refetch = not st.streamed and not st.chunks
            if st.attempts > self.options.integrity_retries or nothing_to_refetch:
                tries = plural(st.attempts, "attempt")
                if not bad:
                    raise IntegrityError(f"{path}: {distrust}, after {tries}")
                expected, actual = bad[0]
                st.got.append(actual)
                raise IntegrityError(f"{path}: {expected.algo} mismatch after {tries}: expected {expected.value}, "
                                     f"got {actual}; {_mismatch_cause(expected, st.got)}")
            if bad:
                expected, actual = bad[0]
                st.got.append(actual)
                log.warning("%s: %s mismatch on attempt %d of %d (expected %s, got %s); fetching the file again",
                            path, expected.algo, st.attempts, self.options.integrity_retries + 1, expected.value,
                            actual)
            else:
                log.warning("%s: %s; fetching the file again", path, distrust)
            job.journal.file_reset(job.index)
            if not st.streamed:
                self.progress.rewind(_pkey(job), st.size or 0)
                st.hasher = MultiHasher(job.remote.checksums, st.size)
                st.cursor = 0
                st.hash_owner = st.chunks[0]
                st.waiting.clear()
                for c in st.chunks:
                    c.done = 0
                with self._cond:
                    st.pending = list(st.chunks)
                    self._cond.notify_all()
            return False
        try:
            st.writer.sync()
        except ModelcacheError:
            self._writeback_failed(st)
            raise
        verified = tuple(c.algo for c in st.hasher.expected)
        result = FetchedFile(path, st.size or 0, st.hasher.local_hexdigest(), verified)
        job.journal.file_done(job.index, result.xxh3, verified)
        st.writer.close()
        st.writer = None
        self.progress.file_finished(_pkey(job))
        with self._cond:
            st.result = result
            self._cond.notify_all()
        return True

    def _sync_loop(self, stop: threading.Event) -> None:
        """Make journaled pieces durable every few seconds, then mark the journal."""
        while not stop.wait(self.options.sync_interval):
            self._sync_once()

    def _sync_once(self) -> None:
        # Each journal is marked *before* its files are synced: a piece journaled while they
        # sync may not be in what the sync wrote, and after a reboot a mark is all that says a
        # line's data is on disk. Files of a failed model stay open and are synced too (their
        # chunks are resumed); a finished file was fsynced before its ``F`` line.
        marks: dict[int, tuple[Journal, int]] = {}
        for st in self._states:
            journal = st.job.journal
            if id(journal) not in marks:
                marks[id(journal)] = (journal, journal.mark())
        synced: set[int] = set()
        failed: set[int] = set()
        for st in self._states:
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
                if self._writeback_failed(st):
                    log.error("%s", exc)
        for jid in synced - failed:
            journal, upto = marks[jid]
            try:
                journal.synced(upto)
            except ModelcacheError:
                pass  # a full disk: the workers report it; a missing mark only costs a refetch

    def _writeback_failed(self, st: _FileState) -> bool:
        """Forget a file whose flush failed; True the first time (for one log line per file)."""
        with st.lock:
            first = not st.lost
            st.lost = True
        if first:
            st.job.journal.file_lost(st.job.index)
            # A new file for the next run, not the same inode again: after a failed write-back
            # ext4 can leave the range's extents unwritten on disk while it no longer converts
            # them, so rewriting the same file and fsyncing it (0) still read back as zeros
            # after a remount (seen with tests/test_writeback_error.py). Writers of this run
            # keep their descriptor and fail on their next write.
            with contextlib.suppress(OSError):
                os.unlink(st.job.dest)
        return first
