"""Progress accounting shared by the engine and its displays.

The engine only adds bytes to a ``ProgressTracker`` (cheap, lock-protected counters); displays
(rich bars on a TTY, one plain line every few seconds in logs, the agent's status) read
snapshots from their own thread at their own pace.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FileProgress:
    path: str
    done: int
    total: int | None


@dataclass(frozen=True)
class ProgressSnapshot:
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    rate: float  # bytes/s over the recent window
    elapsed: float
    active: tuple[FileProgress, ...] = field(default=())
    #: Of ``bytes_done``, those found already on disk (a resumed download), not transferred now.
    bytes_resumed: int = 0
    #: What the pull waits for before it can start (another process's lock), or "".
    waiting: str = ""
    #: Of ``bytes_done``, those of files in flight that a resume cannot keep: each is read as one
    #: stream from byte 0 (a server that ignores Range requests).
    bytes_unresumable: int = 0

    @property
    def eta(self) -> float | None:
        if self.bytes_total <= self.bytes_done:
            return 0.0
        # No guess from the first moments of a download (a connection opening, a listing) unless
        # a good part is done already: the agent's first progress line said "eta 2110h54m28s"
        # from its first few kilobytes.
        if self.rate <= 0 or (self.elapsed < ETA_AFTER and self.bytes_done < self.bytes_total * ETA_FRACTION):
            return None
        return (self.bytes_total - self.bytes_done) / self.rate


#: Seconds of transfer, or the part of the bytes done, before a time left is estimated (and shown).
ETA_AFTER = 3.0
ETA_FRACTION = 0.05


class ProgressTracker:
    """Thread-safe byte and file counters with a sliding-window rate."""

    WINDOW = 5.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._done = 0
        self._skipped = 0  # bytes found already present: done, but not transferred
        self._total = 0
        self._files_done = 0
        self._files_total = 0
        self._samples: deque[tuple[float, int]] = deque()
        self._files: dict[str, list[int | None]] = {}  # path -> [done, total]
        self._streamed: set[str] = set()  # files read in one stream (not resumable)
        self._waiting = ""

    def set_waiting(self, what: str) -> None:
        """Say what the pull waits for (shown instead of an empty progress line); "" when it goes on."""
        with self._lock:
            self._waiting = what

    def add_total(self, nbytes: int, nfiles: int = 0) -> None:
        with self._lock:
            self._total += nbytes
            self._files_total += nfiles

    def file_started(self, path: str, total: int | None, already: int = 0, resumable: bool = True) -> None:
        """``resumable`` False: the file is read in one stream, and an interrupt loses what arrived."""
        with self._lock:
            self._files[path] = [already, total]
            if not resumable:
                self._streamed.add(path)

    def advance(self, path: str, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes
            entry = self._files.get(path)
            if entry is not None:
                entry[0] = int(entry[0] or 0) + nbytes

    def skip(self, nbytes: int) -> None:
        """Bytes already present (resume, cache): counted as done but not in the rate."""
        with self._lock:
            self._done += nbytes
            self._skipped += nbytes
            self._samples.clear()

    def rewind(self, path: str, nbytes: int) -> None:
        """Bytes thrown away (a file re-fetched after a checksum mismatch)."""
        with self._lock:
            self._done -= nbytes
            entry = self._files.get(path)
            if entry is not None:
                entry[0] = max(0, int(entry[0] or 0) - nbytes)

    def file_finished(self, path: str) -> None:
        with self._lock:
            self._files_done += 1
            self._files.pop(path, None)

    def snapshot(self) -> ProgressSnapshot:
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, self._done))
            while len(self._samples) > 2 and now - self._samples[0][0] > self.WINDOW:
                self._samples.popleft()
            t0, b0 = self._samples[0]
            if now - t0 > 0.2:
                rate = (self._done - b0) / (now - t0)
            else:  # first look (or just after a skip): the average since the start
                elapsed = now - self._start
                rate = (self._done - self._skipped) / elapsed if elapsed > 0.05 else 0.0
            # Keys may carry a model prefix ("<group>\0<path>") to stay unique; show the path.
            active = tuple(
                FileProgress(p.rsplit("\x00", 1)[-1], int(v[0] or 0), v[1]) for p, v in self._files.items()
            )
            return ProgressSnapshot(
                bytes_done=self._done,
                bytes_total=self._total,
                files_done=self._files_done,
                files_total=self._files_total,
                rate=max(rate, 0.0),
                elapsed=now - self._start,
                active=active,
                bytes_resumed=self._skipped,
                waiting=self._waiting,
                bytes_unresumable=sum(int(v[0] or 0) for p, v in self._files.items() if p in self._streamed),
            )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def plural(count: int, noun: str) -> str:
    """``1 file``, ``3 files``: a count with its noun."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_line(snap: ProgressSnapshot, label: str = "") -> str:
    """One log line: what `kubectl logs` shows every few seconds."""
    if snap.waiting and not snap.bytes_total:
        return f"{label}{snap.waiting}"
    pct = f"{100 * snap.bytes_done / snap.bytes_total:5.1f}%" if snap.bytes_total else "  -  "
    return (
        f"{label}{pct} {human_bytes(snap.bytes_done)}/{human_bytes(snap.bytes_total)} "
        f"files {snap.files_done}/{snap.files_total} {human_bytes(snap.rate)}/s "
        f"eta {human_duration(snap.eta)}"
    )
