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

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tenacity import Retrying

from modelcache.engine.resources import ResourceError
from modelcache.engine.transfer_control import SourceStats, StreamLimit, Watch, Watchdog, retry_policy
from modelcache.engine.transfer_files import (
    PIECE,
    READ_SIZE,
    Chunk,
    FetchedFile,
    FileJob,
    FileState,
    MiB,
    Slot,
    Slots,
    mismatch_cause,
    progress_key,
    sync_once,
)
from modelcache.errors import CancelledError, IntegrityError, ModelcacheError, RateLimitedError, TransientError
from modelcache.runtime.progress import ProgressTracker, human_bytes, plural
from modelcache.sources.base import Source
from modelcache.sources.integrity import MultiHasher
from modelcache.sources.remote import RangeStream
from modelcache.store.diskio import ALIGN, BufferPool, FileWriter, direct_io_supported

log = logging.getLogger(__name__)

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


class TransferEngine:
    def __init__(self, options: TransferOptions | None = None, progress: ProgressTracker | None = None) -> None:
        self.options = (options or TransferOptions()).normalized()
        self.progress = progress or ProgressTracker()
        self._cond = threading.Condition()
        self._states: list[FileState] = []
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
        self._watchdog: Watchdog | None = None  # per run (run): aborts stalled streams

    def cancel(self) -> None:
        self._cancel.set()
        with self._cond:
            self._cond.notify_all()
        # A worker blocked in a read (a stalled server, a long run of chunks) would otherwise
        # only notice at its next request: up to the stall timeout, or a whole file, later.
        if self._watchdog is not None:
            self._watchdog.abort_all()

    def _check_cancelled(self, st: FileState) -> None:
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
        self._states = [FileState(j, opts.chunk_size) for j in jobs]
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
        self._slots = Slots(pool, self._states, self._cancel, self._all_done, self._check_cancelled)
        self._watchdog = watchdog = Watchdog(opts.stall_timeout)
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
            sync_once(self._states)
            watchdog.stop()
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

    def _mark(self, st: FileState, start: bool = False) -> None:
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

    def _prepare(self, st: FileState) -> None:
        job = st.job
        done = job.resume.files.get(job.index)
        if done is not None and os.path.exists(job.dest) and (st.size is None or os.path.getsize(job.dest) == st.size):
            size = os.path.getsize(job.dest)
            st.result = FetchedFile(job.remote.path, size, done[0], done[1])
            self.progress.add_total(size, 1)
            self.progress.skip(size)
            self.progress.file_finished(progress_key(job))
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

    def _open_writer(self, st: FileState) -> FileWriter:
        if st.writer is None:
            d = os.path.dirname(st.job.dest)
            os.makedirs(d, exist_ok=True)
            if d not in self._direct:
                want = self.options.direct_io
                self._direct[d] = direct_io_supported(d) if want is None else want
            st.writer = FileWriter(st.job.dest, st.size, self._direct[d])
            st.hasher = MultiHasher(st.job.remote.checksums, st.size)
            self.progress.file_started(progress_key(st.job), st.size, sum(c.done for c in st.chunks),
                                       resumable=not st.streamed)
        return st.writer

    # ---- scheduling ---------------------------------------------------------------------

    def _next(self) -> tuple[FileState, list[Chunk], Any] | None:
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
                buf = self._slots.free_buffer()
                if buf is None:
                    return None
        finally:
            if buf is not None:
                self._pool.release(buf)

    def _take(self, buf: Any) -> tuple[FileState, list[Chunk], Any] | Literal["done"] | None:
        """Under the engine's lock: a task, "done", or None (a chunk is waiting for a buffer)."""
        while True:
            if self._cancel.is_set():
                return "done"
            if self._busy >= self._limit.limit:  # more threads than allowed streams: wait
                if self._all_done():
                    return "done"
                self._cond.wait(0.5)
                continue
            best: FileState | None = None
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
            if self._all_done():
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

    def _fail(self, st: FileState, exc: BaseException) -> None:
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

    def _read_into(self, st: FileState, stream: RangeStream, view: memoryview, watch: Watch) -> int:
        path = st.job.remote.path
        self._check_cancelled(st)
        try:
            n = stream.readinto(view)
        except Exception as exc:
            self._check_cancelled(st)  # the read failed because cancel() aborted the stream
            if isinstance(exc, ModelcacheError):
                raise
            if watch.stalled:
                raise self._stalled(path) from exc
            if isinstance(exc, OSError):
                raise TransientError(f"{path}: connection error: {exc}") from exc
            raise
        self._check_cancelled(st)  # an aborted stream may also just end early
        if watch.stalled:
            raise self._stalled(path)
        watch.last = time.monotonic()
        return n

    def _chunk_done(self, st: FileState, slot: Slot) -> bool:
        """A chunk is on disk: hash it if the cursor is in it, else park its buffer (True)."""
        parked, complete = st.chunk_done(slot, self._pool, lambda: st.job.group in self._failed_groups)
        if complete:
            self._finish_file(st)
        return parked

    def _all_done(self) -> bool:
        return all(st.finished or st.job.group in self._failed_groups for st in self._states)

    def _fetch_run(self, st: FileState, run: list[Chunk], writer: FileWriter, buf: Any) -> None:
        """Fetch consecutive chunks through as few requests as possible (``_RunFetch``)."""
        _RunFetch(self, st, run, writer, buf).fetch()

    def _fetch_stream(self, st: FileState, writer: FileWriter, buf: Any) -> None:
        """A file the backend cannot range: one sequential stream, hashed inline, restarted on error."""
        view = memoryview(buf)
        path = st.job.remote.path
        for _ in range(self.options.integrity_retries + 1):
            total = 0
            for attempt in self._retrying(path):
                with attempt:
                    self.progress.rewind(progress_key(st.job), total)
                    total = 0
                    st.hasher = MultiHasher(st.job.remote.checksums, st.size)
                    self._check_cancelled(st)
                    self._mark(st, start=True)
                    stream = st.job.source.open_range(st.job.remote, 0, None)
                    assert self._watchdog is not None
                    watch = self._watchdog.watch(stream)
                    try:
                        while True:
                            fill = 0
                            while fill < len(view):
                                n = self._read_into(st, stream, view[fill : fill + READ_SIZE], watch)
                                if n == 0:
                                    break
                                st.hasher.update(view[fill : fill + n])  # while in cache
                                fill += n
                                self.progress.advance(progress_key(st.job), n)
                            if fill:
                                writer.write(total, view[:fill])
                                total += fill
                            if fill < len(view):
                                break
                    finally:
                        self._watchdog.unwatch(watch)
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
            self.progress.rewind(progress_key(st.job), total)

    # ---- in-order hashing and completion ------------------------------------------------

    def _finish_file(self, st: FileState) -> bool:
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
                                     f"got {actual}; {mismatch_cause(expected, st.got)}")
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
                self.progress.rewind(progress_key(job), st.size or 0)
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
            st.forget_lost()
            raise
        verified = tuple(c.algo for c in st.hasher.expected)
        result = FetchedFile(path, st.size or 0, st.hasher.local_hexdigest(), verified)
        job.journal.file_done(job.index, result.xxh3, verified)
        st.writer.close()
        st.writer = None
        self.progress.file_finished(progress_key(job))
        with self._cond:
            st.result = result
            self._cond.notify_all()
        return True

    def _sync_loop(self, stop: threading.Event) -> None:
        """Make journaled pieces durable every few seconds, then mark the journals (sync_once)."""
        while not stop.wait(self.options.sync_interval):
            sync_once(self._states)


class _RunFetch:
    """One run of consecutive chunks of one file, fetched through as few requests as possible,
    one buffer per chunk (the run's first comes with it; one hashed at once is reused for the next).

    Bytes already in a buffer survive a failed attempt: the retry asks only for the rest, from
    ``position()``. Fields: the chunk the run is in (``i``) and its ``slot``, the open ``stream``
    and its ``watch``, and the request's timing (``opened``, ``first_byte``, ``got``) for SourceStats.
    """

    def __init__(self, engine: TransferEngine, st: FileState, run: list[Chunk], writer: FileWriter,
                 buf: Any) -> None:
        self.engine, self.st, self.run, self.writer = engine, st, run, writer
        self.end = run[-1].end
        self.key = progress_key(st.job)
        self.i = 0
        self.slot: Slot | None = None
        self.stream: RangeStream | None = None
        self.watch: Watch | None = None
        self.opened = self.first_byte = 0.0
        self.got = 0
        try:
            self.slot = engine._slots.slot(st, run[0], writer, buf)
        except BaseException:
            engine._pool.release(buf)
            raise

    def position(self) -> int:
        """How far the run got: a retry that moved it forward starts a new streak (retry_policy)."""
        if self.i >= len(self.run):
            return self.end
        return self.run[self.i].start + (self.slot.pos if self.slot is not None else 0)

    def fetch(self) -> None:
        engine, st = self.engine, self.st
        try:
            for attempt in engine._retrying(f"{st.job.remote.path} bytes {self.run[0].start}-{self.end}",
                                            self.position):
                with attempt:
                    try:
                        while self.i < len(self.run):
                            self.fill(self.run[self.i])
                            self.finish_chunk()
                        if self.stream is not None and self.got:
                            engine._stats(st.job.source).observe(self.first_byte - self.opened, self.got,
                                                                 time.monotonic() - self.first_byte)
                    finally:
                        self.close()
        finally:
            if self.slot is not None:
                engine._pool.release(self.slot.buf)

    def open(self, c: Chunk, slot: Slot) -> RangeStream:
        """A request for the rest of the run, from where the chunk's slot stopped."""
        engine, st = self.engine, self.st
        engine._check_cancelled(st)
        self.opened = time.monotonic()
        engine._mark(st, start=True)
        stream = self.stream = st.job.source.open_range(st.job.remote, c.start + slot.pos, self.end)
        assert engine._watchdog is not None
        self.watch = engine._watchdog.watch(stream)
        self.first_byte, self.got = 0.0, 0
        return stream

    def fill(self, c: Chunk) -> None:
        """Read the chunk into its slot, hashing where the cursor is and writing every PIECE."""
        engine, st, slot = self.engine, self.st, self.slot
        assert slot is not None
        stream = self.stream
        if slot.pos < c.length and stream is None:
            stream = self.open(c, slot)
        while slot.pos < c.length:
            assert stream is not None and self.watch is not None
            n = engine._read_into(st, stream, slot.space(), self.watch)
            if n == 0:
                raise TransientError(f"{st.job.remote.path}: short read at byte {c.start + slot.pos} "
                                     f"(expected up to {self.end})")
            if not self.got:
                self.first_byte = time.monotonic()
            self.got += n
            slot.pos += n
            if st.hash_owner is c:  # the cursor is here: hash while in cache
                assert st.hasher is not None
                slot.hash_into(st.hasher)
            engine.progress.advance(self.key, n)
            if slot.pos - slot.written >= PIECE and slot.pos < c.length:
                slot.write(self.writer, st.job.journal, st.job.index)
        if slot.written < c.length:
            slot.write(self.writer, st.job.journal, st.job.index)

    def finish_chunk(self) -> None:
        """The chunk is on disk: hash or park it, and begin the run's next chunk."""
        engine, st = self.engine, self.st
        c = self.run[self.i]
        c.done = c.length
        engine._mark(st)
        # The buffer goes back to the pool unless it was parked, also when completing the chunk
        # raises (a final checksum mismatch, a failed fsync): a leaked buffer shrinks the pool for
        # the rest of the run, and once spares + 1 are lost a worker waits for buffers for ever.
        done, self.slot, parked = self.slot, None, False
        assert done is not None
        reuse = None
        try:
            parked = engine._chunk_done(st, done)
            if not parked and self.i + 1 < len(self.run):
                reuse = done.buf
        finally:
            if not parked and reuse is None:
                engine._pool.release(done.buf)
        self.i += 1
        if self.i < len(self.run):
            self.slot = engine._slots.slot(st, self.run[self.i], self.writer, reuse)

    def close(self) -> None:
        if self.stream is not None:
            assert self.engine._watchdog is not None and self.watch is not None
            self.engine._watchdog.unwatch(self.watch)
            self.stream.close()
            self.stream = None
