"""The transfer engine: parallel ranged reads into preallocated files, verified, resumable.

It knows nothing about backends. Files are cut into chunks (aligned for O_DIRECT); a fixed
pool of workers takes chunks, preferring the file with the fewest workers on it so that with
many shards each worker streams one file in order. A worker reads its chunk into a pooled
buffer, writing pieces to disk as they arrive and journaling them, and retries the rest of the
chunk with backoff on connection errors, 5xx, short reads and stalls. Each file is hashed in
order (xxh3-128 plus the source's checksums) from the buffers as chunks complete; a chunk that
finishes ahead of its predecessor keeps its buffer if a spare one is free, else it is read
back from disk when its turn comes. Memory is bounded by (workers + spares) x chunk size.
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

from tenacity import Retrying

from modelcache.diskio import ALIGN, BufferPool, FileWriter, direct_io_supported
from modelcache.errors import CancelledError, IntegrityError, ModelcacheError, RateLimitedError, TransientError
from modelcache.integrity import MultiHasher
from modelcache.journal import Journal, JournalState
from modelcache.progress import ProgressTracker, human_bytes
from modelcache.remote import RangeStream, RemoteFile
from modelcache.resources import ResourceError
from modelcache.sources.base import Source
from modelcache.transfer_control import SourceStats, StreamLimit, Watchdog, retry_policy

log = logging.getLogger(__name__)

MiB = 1 << 20
PIECE = 4 * MiB  # written and journaled as it arrives: what a kill -9 can lose per chunk
READ_SIZE = 1 * MiB
#: Pending chunks of a file a source that picks its own order (peer transfer) chooses among.
PICK_WINDOW = 64


@dataclass(frozen=True)
class TransferOptions:
    workers: int = 8  # streams at the start (and at most, unless max_workers is higher)
    chunk_size: int = 16 * MiB
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


@dataclass
class _Chunk:
    index: int
    start: int
    end: int
    done: int = 0  # bytes already on disk from the start of the chunk

    @property
    def length(self) -> int:
        return self.end - self.start


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
        self.cursor = 0
        self.waiting: dict[int, tuple[_Chunk, Any]] = {}  # chunk start -> (chunk, parked buffer or None)
        self.hasher: MultiHasher | None = None
        self.attempts = 0
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
            self.progress.file_started(_pkey(st.job), st.size, sum(c.done for c in st.chunks))
        return st.writer

    # ---- scheduling ---------------------------------------------------------------------

    def _next(self) -> tuple[_FileState, list[_Chunk]] | None:
        """The next request: a run of consecutive fresh chunks of the least-served file."""
        with self._cond:
            while True:
                if self._cancel.is_set():
                    return None
                if self._busy >= self._limit.limit:  # more threads than allowed streams: wait
                    if all(st.finished or st.job.group in self._failed_groups for st in self._states):
                        return None
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
                    best.active += 1
                    self._busy += 1
                    sid = id(best.job.source)
                    self._source_busy[sid] = self._source_busy.get(sid, 0) + 1
                    first = 0
                    if not best.streamed and best.job.source.picks_chunks:
                        window = [c.start for c in best.pending[:PICK_WINDOW]]
                        first = min(max(0, best.job.source.pick_chunk(best.job.remote, window)), len(window) - 1)
                    run = [best.pending.pop(first)]
                    if not best.streamed and run[0].done == 0 and first == 0:
                        limit = self._stats(best.job.source).run_length
                        while (len(run) < limit and best.pending and best.pending[0].done == 0
                               and best.pending[0].start == run[-1].end):
                            run.append(best.pending.pop(0))
                    return best, run
                if all(st.finished or st.job.group in self._failed_groups for st in self._states):
                    return None
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
            st, run = task
            try:
                with st.lock:
                    writer = self._open_writer(st)
                if st.streamed:
                    buf = self._pool.acquire()
                    try:
                        self._fetch_stream(st, writer, buf)
                    finally:
                        self._pool.release(buf)
                else:
                    self._fetch_run(st, run, writer)
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
        # Spare buffers parked for the failed model's in-order hashing go back to the pool, or
        # the models still running would lose them. Lock order as in _chunk_done: file, engine.
        for other in self._states:
            if other.job.group != st.job.group:
                continue
            with other.lock:
                held = [(start, c, b) for start, (c, b) in other.waiting.items() if b is not None]
                for start, c, _ in held:
                    other.waiting[start] = (c, None)
            if held:
                with self._cond:
                    self._pool.parked -= len(held)
                for _, _, b in held:
                    self._pool.release(b)

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

    def _fetch_run(self, st: _FileState, run: list[_Chunk], writer: FileWriter) -> None:
        """Fetch consecutive chunks through as few requests as possible, one buffer per chunk.

        Bytes already in a buffer survive a failed attempt: the retry asks only for the rest.
        """
        path = st.job.remote.path
        stats = self._stats(st.job.source)
        end = run[-1].end
        i = 0
        buf: Any = None
        view = memoryview(b"")
        pos = written = 0
        stream: RangeStream | None = None
        entry: list[Any] = []
        opened = first_byte = 0.0
        got = 0

        def begin(c: _Chunk) -> None:
            nonlocal buf, view, pos, written
            buf = self._pool.acquire()
            view = memoryview(buf)[: c.length]
            # On disk from an earlier run: in-order hashing needs it in memory.
            if c.done and writer.read(c.start, view[: c.done]) != c.done:
                c.done = 0
            pos = written = c.done

        def close_stream() -> None:
            nonlocal stream
            if stream is not None:
                self._watchdog.unwatch(entry)
                stream.close()
                stream = None

        begin(run[0])
        try:
            def position() -> int:
                return run[i].start + pos if i < len(run) else end

            for attempt in self._retrying(f"{path} bytes {run[0].start}-{end}", position):
                with attempt:
                    try:
                        while i < len(run):
                            c = run[i]
                            if pos < c.length and stream is None:
                                self._check_cancelled(st)
                                opened = time.monotonic()
                                stream = st.job.source.open_range(st.job.remote, c.start + pos, end)
                                entry = self._watchdog.watch(stream)
                                first_byte = 0.0
                                got = 0
                            while pos < c.length:
                                assert stream is not None
                                n = self._read_into(st, stream, view[pos : min(c.length, pos + READ_SIZE)], entry)
                                if n == 0:
                                    raise TransientError(
                                        f"{path}: short read at byte {c.start + pos} (expected up to {end})"
                                    )
                                if not got:
                                    first_byte = time.monotonic()
                                got += n
                                pos += n
                                self.progress.advance(_pkey(st.job), n)
                                if pos - written >= PIECE and pos < c.length:
                                    upto = pos - (pos % ALIGN)
                                    writer.write(c.start + written, view[written:upto])
                                    written = upto
                                    st.job.journal.chunk(st.job.index, c.index, written)
                            if written < c.length:
                                writer.write(c.start + written, view[written : c.length])
                                st.job.journal.chunk(st.job.index, c.index, c.length)
                                written = c.length
                            c.done = c.length
                            # The buffer goes back to the pool unless it was parked, also when
                            # completing the chunk raises (a final checksum mismatch, a failed
                            # fsync): a leaked buffer shrinks the pool for the rest of the run,
                            # and once spares + 1 are lost a worker waits in acquire() for ever.
                            held, buf, parked = buf, None, False
                            try:
                                parked = self._chunk_done(st, c, held)
                            finally:
                                if not parked:
                                    self._pool.release(held)
                            i += 1
                            if i < len(run):
                                begin(run[i])
                        if stream is not None and got:
                            stats.observe(first_byte - opened, got, time.monotonic() - first_byte)
                    finally:
                        close_stream()
        finally:
            if buf is not None:
                self._pool.release(buf)

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
                    stream = st.job.source.open_range(st.job.remote, 0, None)
                    entry = self._watchdog.watch(stream)
                    try:
                        while True:
                            fill = 0
                            while fill < len(view):
                                n = self._read_into(st, stream, view[fill:], entry)
                                if n == 0:
                                    break
                                fill += n
                                self.progress.advance(_pkey(st.job), n)
                            if fill:
                                st.hasher.update(view[:fill])
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
            if st.size is None:
                st.size = total
                self.progress.add_total(total)
            if self._finish_file(st):
                return
            self.progress.rewind(_pkey(st.job), total)

    # ---- in-order hashing and completion ------------------------------------------------

    def _chunk_done(self, st: _FileState, chunk: _Chunk, buf: Any) -> bool:
        """Hash what is now contiguous; returns True if ``buf`` was parked for later hashing."""
        parked = False
        with st.lock:
            if chunk.start != st.cursor:
                with self._cond:
                    spare = self._pool.parked < (self.options.spare_buffers or 0)
                    if spare and st.job.group not in self._failed_groups:
                        self._pool.parked += 1
                        parked = True
                st.waiting[chunk.start] = (chunk, buf if parked else None)
                return parked
            assert st.hasher is not None
            st.hasher.update(memoryview(buf)[: chunk.length])
            st.cursor = chunk.end
            self._drain(st)
            complete = st.size is not None and st.cursor >= st.size
        if complete:
            self._finish_file(st)
        return False

    def _drain(self, st: _FileState) -> None:
        assert st.hasher is not None and st.writer is not None
        while st.cursor in st.waiting:
            c, held = st.waiting.pop(st.cursor)
            if held is not None:
                st.hasher.update(memoryview(held)[: c.length])
                with self._cond:
                    self._pool.parked -= 1
                self._pool.release(held)
            else:
                self._hash_from_disk(st, c)
            st.cursor = c.end

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
                if not bad:
                    raise IntegrityError(f"{path}: {distrust}, after {st.attempts} attempts")
                expected, actual = bad[0]
                raise IntegrityError(
                    f"{path}: {expected.algo} mismatch after {st.attempts} attempts: expected {expected.value}, "
                    f"got {actual}; the source object is corrupt or changed during download"
                )
            if bad:
                expected, actual = bad[0]
                log.warning("%s: %s mismatch (expected %s, got %s); fetching the file again",
                            path, expected.algo, expected.value, actual)
            else:
                log.warning("%s: %s; fetching the file again", path, distrust)
            job.journal.file_reset(job.index)
            if not st.streamed:
                self.progress.rewind(_pkey(job), st.size or 0)
                st.hasher = MultiHasher(job.remote.checksums, st.size)
                st.cursor = 0
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
