"""How often caches write their status while their members report progress, and when node
writes wait for caches still arriving (:class:`CacheBurst`).

A cache's status (``nodeStatus``, ``copies``) changes each time one of its members reports, and a
rollout of 200 caches over 10,000 nodes is 200,000 reports. One write per cache per second is
still up to 200 writes a second across the caches for as long as the rollout lasts, plus an
event with each. So progress is paced across all caches together: each cache writes at most once
per ``min_interval``, and all of them together about ``rate`` times a second (with 200 caches
reporting at once, each one every 400 s). A new cache (or any cache after a restart) is paced the
same way from when it first asks: its first status, written while its members' entries are not
even there yet, is 1,000 members' ``nodeStatus`` of nothing but pending (bench/coordinator_scale.py
at 10,000 nodes: 200 new caches wrote 7 MB of it at once, 17.5 % of the coordinator's API time).
What someone waits for or must act on is not paced: a cache whose members have all reported
(done or failed), and a cache ``urge``d by an event that needs showing now (a copy lost, a
download failed, the cache's spec, its groups, volumes or services changed, a member joined, left
or went NotReady).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

#: Progress writes per second, all caches together (a cache alone: one every two seconds).
#: bench/coordinator_scale.py, 2,000 nodes and 80 caches: 828 status writes (0.41 per node) at
#: one a second per cache; a rollout of T seconds now costs at most T / 2 of them.
RATE = 0.5
#: At most one status write per cache per this many seconds, whatever the pace.
MIN_INTERVAL = 1.0
#: A cache counts as reporting progress for this long after it last asked to write.
WINDOW = 30.0


class StatusPacer:
    """Thread-safe: shared by the cluster and namespace cache reconcilers."""

    def __init__(self, rate: float = RATE, min_interval: float = MIN_INTERVAL, window: float = WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.min_interval, self.window, self.clock = rate, min_interval, window, clock
        self._asked: dict[str, float] = {}  # cache key -> when it last had progress to write
        self._written: dict[str, float] = {}  # cache key -> when it last wrote
        self._first: dict[str, float] = {}  # cache key never written -> when it first asked
        self._due: dict[str, float] = {}  # cache key paced -> when its progress may be written
        self._urgent: set[str] = set()
        self._lock = threading.Lock()

    def interval(self) -> float:
        """Seconds between two progress writes of one cache, now."""
        with self._lock:
            return self._interval(self.clock())

    def _interval(self, now: float) -> float:
        """Caller holds the lock."""
        for key in [k for k, t in self._asked.items() if now - t > self.window]:
            del self._asked[key]
        return max(self.min_interval, len(self._asked) / self.rate)

    def urge(self, keys: Iterable[str]) -> None:
        """The next status of these caches is not paced (only ``min_interval`` applies)."""
        with self._lock:
            self._urgent.update(keys)

    def wait(self, key: str, progress: bool) -> float:
        """Seconds until ``key`` may write its status (0: now). ``progress``: its members are still
        reporting (the write is paced unless the cache was urged)."""
        now = self.clock()
        with self._lock:
            since = now - self._written.get(key, float("-inf"))
            if not progress or key in self._urgent:
                wait = max(0.0, self.min_interval - since)
                if wait == 0:
                    self._urgent.discard(key)  # taken: an urge from now on counts for the next one
                return wait
            self._asked[key] = now
            if key not in self._written:  # never written: one interval from its first ask
                since = now - self._first.setdefault(key, now)
            wait = max(0.0, self._interval(now) - since)
            self._due[key] = now + wait
            return wait

    def paced(self, key: str) -> bool:
        """Whether ``key``'s progress is waiting for its pace now (its reconcile asked, was told
        to wait, and that time has not come; not urged since): more progress need not wake it
        before then (coordinator/controllers.py)."""
        now = self.clock()
        with self._lock:
            return self._due.get(key, now) > now and key not in self._urgent

    def wrote(self, key: str) -> None:
        with self._lock:
            self._written[key] = self.clock()
            self._first.pop(key, None)
            self._due.pop(key, None)

    def forget(self, key: str) -> None:
        with self._lock:
            self._asked.pop(key, None)
            self._written.pop(key, None)
            self._first.pop(key, None)
            self._due.pop(key, None)
            self._urgent.discard(key)


#: A burst of cache changes (created, deleted, spec changed) ends once none came for this long:
#: one client creating 200 caches one after another leaves well under a second between two.
BURST_QUIET = 1.0
#: ... and holds node writes at most this long from its first change (a steady stream of cache
#: changes must not hold them for ever).
BURST_LONGEST = 30.0


class CacheBurst:
    """Node writes wait while caches are still arriving, so that a node's LocalModelNode gets all
    of a burst's entries in one write. bench/coordinator_scale.py at 10,000 nodes (200 caches
    created one after another): the nodes reconciled while the caches were still being created
    got a LocalModelNode with some of them, written again with the rest (391 LocalModelNode
    updates), and their agents reported and their Nodes were labelled twice (391 label patches).
    Thread-safe."""

    def __init__(self, quiet: float = BURST_QUIET, longest: float = BURST_LONGEST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet, self.longest, self.clock = quiet, longest, clock
        self._start = self._last = float("-inf")
        self._lock = threading.Lock()

    def saw(self) -> None:
        """A cache was created or deleted or its spec changed."""
        now = self.clock()
        with self._lock:
            if now - self._last >= self.quiet:
                self._start = now  # a new burst
            self._last = now

    def hold(self) -> float:
        """Seconds node writes should still wait (0: now)."""
        now = self.clock()
        with self._lock:
            left = min(self._last + self.quiet, self._start + self.longest) - now
        return max(0.0, left)
