"""How the engine treats a backend's requests: how big, how often retried, when aborted.

Kept apart from the engine's scheduling and disk work: ``SourceStats`` sizes requests from
what a server's responses cost to start, ``retry_policy`` retries a request while it makes
progress, and ``Watchdog`` aborts a stream that stopped delivering bytes (the stall timeout).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception

from modelcache.errors import IntegrityError, ModelcacheError, RateLimitedError
from modelcache.runtime.loop import Loop
from modelcache.sources.remote import RangeStream

log = logging.getLogger("modelcache.engine.transfer")


class SourceStats:
    """How a backend answers, to size requests: a server that takes long to start each response
    (moto reads the whole object per ranged GET; some proxies pay per request) gets longer runs
    of chunks per request, a fast one single chunks, for the most parallelism."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.run_length = 1
        self._lock = threading.Lock()
        self._ttfb: float | None = None
        self._rate: float | None = None

    def observe(self, ttfb: float, nbytes: int, seconds: float) -> None:
        with self._lock:
            rate = nbytes / max(seconds, 1e-6)
            self._ttfb = ttfb if self._ttfb is None else 0.7 * self._ttfb + 0.3 * ttfb
            self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate
            chunk_time = self.chunk_size / max(self._rate, 1.0)
            if self._ttfb > 0.25 * chunk_time:
                self.run_length = min(self.run_length * 2, 1024)
            elif self._ttfb < 0.05 * chunk_time and self.run_length > 1:
                self.run_length //= 2


@dataclass(eq=False, slots=True)
class Watch:
    """One stream the watchdog watches: when its reader last got bytes, and whether it was aborted
    for a stall (its reader then raises a stall error, not the stream's own)."""

    stream: RangeStream
    last: float = field(default_factory=time.monotonic)
    stalled: bool = False

    def abort(self) -> None:
        try:
            self.stream.abort()
        except Exception:  # the stream is being torn down either way
            pass


class Watchdog:
    """Aborts streams that delivered no bytes for ``timeout`` seconds (the stall timeout)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._watches: set[Watch] = set()
        self._loop = Loop("modelcache-watchdog", self._check, min(1.0, timeout / 4), at_start=False).start()

    def watch(self, stream: RangeStream) -> Watch:
        watch = Watch(stream)
        with self._lock:
            self._watches.add(watch)
        return watch

    def unwatch(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def _check(self) -> None:
        now = time.monotonic()
        with self._lock:
            stalled = [w for w in self._watches if not w.stalled and now - w.last > self.timeout]
            for w in stalled:
                w.stalled = True
        for w in stalled:
            w.abort()

    def abort_all(self) -> None:
        """Wake every reader blocked in a stream (cancel): they must not wait for the stall timeout."""
        with self._lock:
            watches = list(self._watches)
        for w in watches:
            w.abort()

    def stop(self) -> None:
        self._loop.stop(timeout=0)  # never waits: a check in flight only aborts streams


def retryable(exc: BaseException) -> bool:
    return isinstance(exc, ModelcacheError) and exc.retryable and not isinstance(exc, IntegrityError)


class _Streak:
    """Failures in a row without progress: a failure at a later position starts a new streak."""

    def __init__(self, at: int) -> None:
        self.failures, self.at = 0, at

    def failed(self, now: int) -> int:
        if now > self.at:
            self.failures, self.at = 0, now
        self.failures += 1
        return self.failures


def retry_policy(
    what: str,
    max_attempts: int,
    backoff_initial: float,
    backoff_max: float,
    position: Callable[[], int] | None = None,
    sleep: Callable[[float], Any] = time.sleep,
    on_retry: Callable[[BaseException | None], None] | None = None,
) -> Retrying:
    """Retry policy for one request: ``max_attempts`` failures in a row *without progress*.

    ``position`` tells how far the request got; an attempt that moved it forward resets
    the count and the backoff, so a long run of chunks on a flaky link still completes
    while a dead server fails after a bounded time. 429s wait their Retry-After.
    """
    streak = _Streak(position() if position else 0)

    def stop(state: RetryCallState) -> bool:
        return streak.failed(position() if position else 0) >= max_attempts

    def wait(state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, RateLimitedError) and exc.retry_after:
            return min(exc.retry_after, 300.0)
        return min(backoff_max, backoff_initial * (2 ** (streak.failures - 1)))

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("%s: attempt %d failed (%s); retrying", what, state.attempt_number, exc)
        if on_retry is not None:
            on_retry(exc)

    return Retrying(stop=stop, wait=wait, retry=retry_if_exception(retryable),
                    before_sleep=before_sleep, reraise=True, sleep=sleep)


class StreamLimit:
    """How many requests run at once: grows while throughput grows, steps back when it stops.

    Servers that cap each connection (real S3, CDNs) need many streams; a local or CPU-bound
    one gains nothing past a few. A hill climb on measured throughput finds the knee: while all
    allowed streams are busy, add ``step`` and keep the step if the rate rose by ``gain``;
    otherwise undo it and hold for ``hold`` rounds before probing again. Errors from the server
    (429, 5xx) shrink the limit at once.
    """

    def __init__(self, start: int, maximum: int, step: int = 2, gain: float = 0.10, hold: int = 5) -> None:
        self.limit = max(1, min(start, maximum))
        self.minimum = max(1, min(start, maximum) // 2)
        self.maximum = max(maximum, self.limit)
        self.step = step
        self.gain = gain
        self.hold = hold
        self._best: float | None = None
        self._probing = 0  # streams added by the step under test
        self._cooldown = 0

    def observe(self, rate: float, saturated: bool) -> int:
        """Feed the last interval's bytes/s; returns the new limit."""
        if self._probing:
            if self._best is not None and rate > self._best * (1 + self.gain):
                self._best, self._probing = rate, 0  # the step paid: keep it
            else:
                self.limit -= self._probing  # no gain: undo and rest
                self._probing, self._cooldown = 0, self.hold
            return self.limit
        if self._best is None or rate > self._best:
            self._best = rate
        if self._cooldown:
            self._cooldown -= 1
            return self.limit
        if saturated and self.limit < self.maximum:
            self._probing = min(self.step, self.maximum - self.limit)
            self.limit += self._probing
        return self.limit

    def backoff(self) -> int:
        """The server pushed back (429/503): fewer streams, and no probing for a while."""
        self.limit = max(self.minimum, self.limit - self.step)
        self._probing, self._cooldown, self._best = 0, self.hold, None
        return self.limit
