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

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

from modelcache.diskio import ALIGN, BufferPool, FileWriter, direct_io_supported
from modelcache.errors import IntegrityError, ModelcacheError, RateLimitedError, TransientError
from modelcache.integrity import MultiHasher
from modelcache.journal import Journal, JournalState
from modelcache.progress import ProgressTracker
from modelcache.sources.base import RangeStream, RemoteFile, Source

log = logging.getLogger(__name__)

MiB = 1 << 20
PIECE = 4 * MiB  # written and journaled as it arrives: what a kill -9 can lose per chunk
READ_SIZE = 1 * MiB


@dataclass(frozen=True)
class TransferOptions:
    workers: int = 8
    chunk_size: int = 16 * MiB
    spare_buffers: int | None = None  # default: workers // 2
    max_attempts: int = 6
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    stall_timeout: float = 30.0
    direct_io: bool | None = None  # None: use O_DIRECT where the file system accepts it
    integrity_retries: int = 2  # re-fetches of a file whose bytes did not match its checksum

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

    def _plan(self, chunk_size: int) -> list[_Chunk]:
        if self.streamed:
            return [_Chunk(0, 0, self.size if self.size is not None else -1)]
        size = self.size or 0
        return [_Chunk(i, s, min(s + chunk_size, size)) for i, s in enumerate(range(0, size, chunk_size))]

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None


class _Watchdog:
    """Aborts streams that delivered no bytes for ``timeout`` seconds (the stall timeout)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._streams: dict[int, list[Any]] = {}  # id -> [stream, last_progress, stalled]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="modelcache-watchdog", daemon=True)
        self._thread.start()

    def watch(self, stream: RangeStream) -> list[Any]:
        entry = [stream, time.monotonic(), False]
        with self._lock:
            self._streams[id(entry)] = entry
        return entry

    def unwatch(self, entry: list[Any]) -> None:
        with self._lock:
            self._streams.pop(id(entry), None)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            now = time.monotonic()
            with self._lock:
                stalled = [e for e in self._streams.values() if not e[2] and now - e[1] > self.timeout]
                for e in stalled:
                    e[2] = True
            for e in stalled:
                abort = getattr(e[0], "abort", None) or e[0].close
                try:
                    abort()
                except Exception:  # the stream is being torn down either way
                    pass

    def stop(self) -> None:
        self._stop.set()


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, ModelcacheError) and exc.retryable and not isinstance(exc, IntegrityError)


class TransferEngine:
    def __init__(self, options: TransferOptions | None = None, progress: ProgressTracker | None = None) -> None:
        self.options = (options or TransferOptions()).normalized()
        self.progress = progress or ProgressTracker()
        self._cond = threading.Condition()
        self._states: list[_FileState] = []
        self._failed_groups: dict[str, BaseException] = {}
        self._direct: dict[str, bool] = {}
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()
        with self._cond:
            self._cond.notify_all()

    # ---- public entry point -------------------------------------------------------------

    def run(self, jobs: list[FileJob]) -> tuple[dict[str, list[FetchedFile]], dict[str, BaseException]]:
        """Fetch every job; returns per-group results and per-group errors."""
        opts = self.options
        self._states = [_FileState(j, opts.chunk_size) for j in jobs]
        for st in self._states:
            self._prepare(st)
        pool = BufferPool(opts.workers + (opts.spare_buffers or 0), opts.chunk_size)
        self._pool = pool
        self._watchdog = _Watchdog(opts.stall_timeout)
        syncer_stop = threading.Event()
        syncer = threading.Thread(target=self._sync_loop, args=(syncer_stop,), name="modelcache-sync", daemon=True)
        syncer.start()
        workers = [
            threading.Thread(target=self._worker, name=f"modelcache-worker-{i}", daemon=True)
            for i in range(opts.workers)
        ]
        try:
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            syncer_stop.set()
            syncer.join()
            self._watchdog.stop()
            for st in self._states:
                if st.writer is not None:
                    st.writer.close()
            pool.close()
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
            self.progress.file_finished(job.remote.path)
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
            self.progress.file_started(st.job.remote.path, st.size, sum(c.done for c in st.chunks))
        return st.writer

    # ---- scheduling ---------------------------------------------------------------------

    def _next(self) -> tuple[_FileState, _Chunk] | None:
        with self._cond:
            while True:
                if self._cancel.is_set():
                    return None
                best: _FileState | None = None
                for st in self._states:
                    runnable = st.pending and not st.finished and st.job.group not in self._failed_groups
                    if runnable and (best is None or st.active < best.active):
                        best = st
                if best is not None:
                    best.active += 1
                    return best, best.pending.pop(0)
                if all(st.finished or st.job.group in self._failed_groups for st in self._states):
                    return None
                self._cond.wait(0.5)

    def _worker(self) -> None:
        while True:
            task = self._next()
            if task is None:
                return
            st, chunk = task
            buf = self._pool.acquire()
            keep_buf = False
            try:
                with st.lock:
                    writer = self._open_writer(st)
                if st.streamed:
                    self._fetch_stream(st, writer, buf)
                else:
                    self._fetch_chunk(st, chunk, writer, buf)
                    keep_buf = self._chunk_done(st, chunk, buf)
            except BaseException as exc:
                self._fail(st, exc)
            finally:
                if not keep_buf:
                    self._pool.release(buf)
                with self._cond:
                    st.active -= 1
                    self._cond.notify_all()

    def _fail(self, st: _FileState, exc: BaseException) -> None:
        with self._cond:
            st.error = exc
            self._failed_groups.setdefault(st.job.group, exc)
            self._cond.notify_all()

    # ---- fetching -----------------------------------------------------------------------

    def _retrying(self, what: str) -> Retrying:
        opts = self.options

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, RateLimitedError) and exc.retry_after:
                return min(exc.retry_after, 300.0)
            return min(opts.backoff_max, opts.backoff_initial * (2 ** (state.attempt_number - 1)))

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("%s: attempt %d failed (%s); retrying", what, state.attempt_number, exc)

        return Retrying(
            stop=stop_after_attempt(opts.max_attempts),
            wait=wait,
            retry=retry_if_exception(_retryable),
            before_sleep=before_sleep,
            reraise=True,
        )

    def _read_into(self, stream: RangeStream, view: memoryview, entry: list[Any], path: str) -> int:
        try:
            n = stream.readinto(view)
        except ModelcacheError:
            raise
        except Exception as exc:
            if entry[2]:
                raise TransientError(f"{path}: no data for {self.options.stall_timeout:.0f}s (stalled)") from exc
            if isinstance(exc, OSError):
                raise TransientError(f"{path}: connection error: {exc}") from exc
            raise
        if entry[2]:
            raise TransientError(f"{path}: no data for {self.options.stall_timeout:.0f}s (stalled)")
        entry[1] = time.monotonic()
        return n

    def _fetch_chunk(self, st: _FileState, chunk: _Chunk, writer: FileWriter, buf: Any) -> None:
        view = memoryview(buf)[: chunk.length]
        path = st.job.remote.path
        # On disk from an earlier run: in-order hashing needs it in memory.
        if chunk.done and writer.read(chunk.start, view[: chunk.done]) != chunk.done:
            chunk.done = 0
        # ``pos`` survives failed attempts: bytes already in the buffer are not asked for again.
        pos = written = chunk.done
        for attempt in self._retrying(f"{path} bytes {chunk.start}-{chunk.end}"):
            with attempt:
                if pos >= chunk.length:
                    break
                if self._cancel.is_set() or st.job.group in self._failed_groups:
                    raise ModelcacheError("cancelled")
                stream = st.job.source.open_range(st.job.remote, chunk.start + pos, chunk.end)
                entry = self._watchdog.watch(stream)
                try:
                    while pos < chunk.length:
                        n = self._read_into(stream, view[pos : min(chunk.length, pos + READ_SIZE)], entry, path)
                        if n == 0:
                            raise TransientError(
                                f"{path}: short read at byte {chunk.start + pos} (expected up to {chunk.end})"
                            )
                        pos += n
                        self.progress.advance(path, n)
                        if pos - written >= PIECE and pos < chunk.length:
                            upto = pos - (pos % ALIGN)
                            writer.write(chunk.start + written, view[written:upto])
                            written = upto
                            st.job.journal.chunk(st.job.index, chunk.index, written)
                finally:
                    self._watchdog.unwatch(entry)
                    stream.close()
        if written < chunk.length:
            writer.write(chunk.start + written, view[written : chunk.length])
            st.job.journal.chunk(st.job.index, chunk.index, chunk.length)
        chunk.done = chunk.length

    def _fetch_stream(self, st: _FileState, writer: FileWriter, buf: Any) -> None:
        """A file the backend cannot range: one sequential stream, hashed inline, restarted on error."""
        view = memoryview(buf)
        path = st.job.remote.path
        for _ in range(self.options.integrity_retries + 1):
            total = 0
            for attempt in self._retrying(path):
                with attempt:
                    self.progress.rewind(path, total)
                    total = 0
                    st.hasher = MultiHasher(st.job.remote.checksums, st.size)
                    stream = st.job.source.open_range(st.job.remote, 0, None)
                    entry = self._watchdog.watch(stream)
                    try:
                        while True:
                            fill = 0
                            while fill < len(view):
                                n = self._read_into(stream, view[fill:], entry, path)
                                if n == 0:
                                    break
                                fill += n
                                self.progress.advance(path, n)
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
            self.progress.rewind(path, total)

    # ---- in-order hashing and completion ------------------------------------------------

    def _chunk_done(self, st: _FileState, chunk: _Chunk, buf: Any) -> bool:
        """Hash what is now contiguous; returns True if ``buf`` was parked for later hashing."""
        parked = False
        with st.lock:
            if chunk.start != st.cursor:
                with self._cond:
                    if self._pool.parked < (self.options.spare_buffers or 0):
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
        bad = st.hasher.mismatches()
        if bad:
            expected, actual = bad[0]
            st.attempts += 1
            if st.attempts > self.options.integrity_retries:
                raise IntegrityError(
                    f"{path}: {expected.algo} mismatch after {st.attempts} attempts: expected {expected.value}, "
                    f"got {actual}; the source object is corrupt or changed during download"
                )
            log.warning("%s: %s mismatch (expected %s, got %s); fetching the file again",
                        path, expected.algo, expected.value, actual)
            job.journal.file_reset(job.index)
            if not st.streamed:
                self.progress.rewind(path, st.size or 0)
                st.hasher = MultiHasher(job.remote.checksums, st.size)
                st.cursor = 0
                st.waiting.clear()
                for c in st.chunks:
                    c.done = 0
                with self._cond:
                    st.pending = list(st.chunks)
                    self._cond.notify_all()
            return False
        st.writer.sync()
        verified = tuple(c.algo for c in st.hasher.expected)
        result = FetchedFile(path, st.size or 0, st.hasher.local_hexdigest(), verified)
        job.journal.file_done(job.index, result.xxh3, verified)
        st.writer.close()
        st.writer = None
        self.progress.file_finished(path)
        with self._cond:
            st.result = result
            self._cond.notify_all()
        return True

    def _sync_loop(self, stop: threading.Event) -> None:
        """Make journaled pieces durable every few seconds, then mark the journal."""
        while not stop.wait(2.0):
            journals: set[int] = set()
            for st in self._states:
                w = st.writer
                if w is not None and not st.finished:
                    try:
                        w.datasync()
                    except OSError:
                        continue
                    journals.add(id(st.job.journal))
            for st in self._states:
                if id(st.job.journal) in journals:
                    journals.discard(id(st.job.journal))
                    st.job.journal.synced()

