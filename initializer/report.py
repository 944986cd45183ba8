"""Plain-text output for init-container logs (not a TTY): periodic progress and a summary.

Progress goes to stdout as one line every few seconds while bytes are moving; each finished
pair gets one line, and the run ends with one summary line. Errors go to stderr, one line per
failed pair. Every line passes through the scrubber.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import TextIO

from initializer.redact import Scrubber
from modelcache.runtime.loop import Loop
from modelcache.runtime.progress import ProgressTracker, format_line, human_bytes, human_duration, plural


@dataclass(frozen=True)
class PairOutcome:
    """What one SRC DEST pair did. ``action``: pulled, cached, linked, no-op."""

    action: str
    files: int = 0
    bytes: int = 0
    unpacked: str = ""  # "<archive name> (<n> files)" when an archive was unpacked


class Reporter:
    def __init__(
        self,
        scrub: Scrubber,
        interval: float = 5.0,
        out: TextIO | None = None,
        err: TextIO | None = None,
        tracker: ProgressTracker | None = None,
    ) -> None:
        self.scrub = scrub
        self.interval = interval
        self.tracker = tracker or ProgressTracker()
        self._out = out or sys.stdout
        self._err = err or sys.stderr
        self._lock = threading.Lock()
        self._loop = Loop("progress", self._progress_line, lambda: self.interval, at_start=False)
        self._start = time.monotonic()
        self._last_done, self._last_t = 0, self._start

    # -- lines ----------------------------------------------------------------------------

    def info(self, text: str) -> None:
        self._emit(self._out, text)

    def error(self, text: str) -> None:
        self._emit(self._err, text)

    def _emit(self, stream: TextIO, text: str) -> None:
        line = self.scrub(text)
        with self._lock:
            stream.write(line + "\n")
            stream.flush()

    def pair_done(self, src: str, dest: str, outcome: PairOutcome, seconds: float) -> None:
        extra = f", unpacked {outcome.unpacked}" if outcome.unpacked else ""
        self.info(
            f"{outcome.action}: {src} -> {dest}: {outcome.files} files, {human_bytes(outcome.bytes)} "
            f"in {seconds:.1f}s{extra}"
        )

    def pair_failed(self, src: str, dest: str, cause: str) -> None:
        self.error(f"error: {src} -> {dest}: {cause}")

    def summary(self, ok: int, failed: int, outcomes: list[PairOutcome]) -> None:
        elapsed = time.monotonic() - self._start
        total_bytes = sum(o.bytes for o in outcomes)
        files = sum(o.files for o in outcomes)
        snap = self.tracker.snapshot()
        # Bytes a resumed download found on disk are done but were not transferred by this run.
        moved = max(0, snap.bytes_done - snap.bytes_resumed)
        rate = moved / elapsed if elapsed > 0 else 0.0
        status = "done" if failed == 0 else "FAILED"
        resumed = f", {human_bytes(snap.bytes_resumed)} resumed from an earlier run" if snap.bytes_resumed else ""
        self.info(
            f"{status}: {ok}/{ok + failed} pairs ok, {plural(files, 'file')}, {human_bytes(total_bytes)} "
            f"({human_bytes(moved)} transferred{resumed}) in {human_duration(elapsed)} ({human_bytes(rate)}/s)"
        )

    # -- periodic progress ----------------------------------------------------------------

    def start(self) -> None:
        self._last_done, self._last_t = 0, time.monotonic()
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(timeout=2)

    def _progress_line(self) -> None:
        snap = self.tracker.snapshot()
        now = time.monotonic()
        if snap.bytes_done == self._last_done:
            return  # nothing moved since the last line: don't spam the log
        # The rate over the last interval: the tracker's own window needs several samples,
        # and at one line every few seconds the first lines would all say 0 B/s.
        rate = max(0.0, (snap.bytes_done - self._last_done) / max(now - self._last_t, 1e-3))
        self._last_done, self._last_t = snap.bytes_done, now
        self.info(format_line(replace(snap, rate=rate), label="progress: "))
