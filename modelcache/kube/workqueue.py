"""A work queue with client-go's guarantees, for level-triggered reconcilers.

* A key waiting in the queue is there once, however often it is added (de-duplication).
* A key being processed is never handed to a second worker; if it is added meanwhile it is
  queued again when the first worker calls :meth:`WorkQueue.done` (so no change is lost).
* A key waiting for :meth:`WorkQueue.add_after` waits there once, for the earliest time it was
  added for (client-go's delaying queue).
* :meth:`WorkQueue.add_rate_limited` requeues with per-key exponential backoff;
  :meth:`WorkQueue.forget` resets it after a success.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable


class ExponentialBackoff:
    """Per-key delay ``base * 2**failures`` capped at ``cap`` (client-go: 5 ms .. 1000 s)."""

    def __init__(self, base: float = 0.005, cap: float = 1000.0) -> None:
        self.base = base
        self.cap = cap
        self._failures: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def when(self, key: Hashable) -> float:
        with self._lock:
            n = self._failures.get(key, 0)
            self._failures[key] = n + 1
        return min(self.cap, self.base * (2**n))

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._failures.pop(key, None)

    def retries(self, key: Hashable) -> int:
        with self._lock:
            return self._failures.get(key, 0)


class ShutDown(Exception):
    """Raised by :meth:`WorkQueue.get` once the queue is shut down."""


class WorkQueue:
    def __init__(self, backoff: ExponentialBackoff | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff = backoff or ExponentialBackoff()
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[Hashable] = deque()
        self._dirty: set[Hashable] = set()  # waiting to be processed (in _queue, or re-added while processing)
        self._processing: set[Hashable] = set()
        self._waiting: list[tuple[float, int, Hashable]] = []  # (ready_at, seq, key) heap for add_after
        #: key -> its ready_at in the heap; an entry of the heap with another ready_at is stale. A
        #: key added after once per event (a node held while 200 caches arrive, each waking its
        #: 1,000 members) waits once, not once per event (bench/coordinator_scale.py).
        self._ready_at: dict[Hashable, float] = {}
        self._seq = itertools.count()
        self._shutdown = False

    # -- adding -----------------------------------------------------------------------------
    def add(self, key: Hashable) -> None:
        with self._cond:
            self._add_locked(key)

    def _add_locked(self, key: Hashable) -> None:
        if self._shutdown or key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.append(key)
            self._cond.notify()

    def add_after(self, key: Hashable, delay: float) -> None:
        """Add ``key`` once ``delay`` seconds have passed (at once if ``delay <= 0``)."""
        with self._cond:
            if self._shutdown:
                return
            if delay <= 0:
                self._add_locked(key)
                return
            ready_at = self._clock() + delay
            if self._ready_at.get(key, float("inf")) <= ready_at:
                return  # waits already, for as soon or sooner
            self._ready_at[key] = ready_at
            heapq.heappush(self._waiting, (ready_at, next(self._seq), key))
            # Wake one getter so it re-computes how long to sleep.
            self._cond.notify()

    def add_rate_limited(self, key: Hashable) -> float:
        """Requeue after the key's next backoff delay; returns the delay."""
        delay = self.backoff.when(key)
        self.add_after(key, delay)
        return delay

    def forget(self, key: Hashable) -> None:
        self.backoff.forget(key)

    def retries(self, key: Hashable) -> int:
        return self.backoff.retries(key)

    # -- taking -----------------------------------------------------------------------------
    def _promote_due_locked(self) -> float | None:
        """Move due delayed keys into the queue; return seconds until the next one is due."""
        now = self._clock()
        while self._waiting and self._waiting[0][0] <= now:
            ready_at, _, key = heapq.heappop(self._waiting)
            if self._ready_at.get(key) != ready_at:
                continue  # stale: the key was added for sooner since
            del self._ready_at[key]
            self._add_locked(key)
        return (self._waiting[0][0] - now) if self._waiting else None

    def get(self, timeout: float | None = None) -> Hashable | None:
        """The next key (now marked processing), or None after ``timeout`` seconds.

        Raises :class:`ShutDown` once the queue is shut down.
        """
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                if self._shutdown:
                    raise ShutDown()
                next_due = self._promote_due_locked()
                if self._queue:
                    key = self._queue.popleft()
                    self._processing.add(key)
                    self._dirty.discard(key)
                    return key
                wait = next_due
                if deadline is not None:
                    left = deadline - self._clock()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def done(self, key: Hashable) -> None:
        """Mark ``key`` finished; if it was added while processing, it goes back in the queue."""
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty and not self._shutdown:
                self._queue.append(key)
                self._cond.notify()

    # -- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()

    @property
    def shutting_down(self) -> bool:
        return self._shutdown

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def pending_delayed(self) -> int:
        with self._cond:
            return len(self._ready_at)
