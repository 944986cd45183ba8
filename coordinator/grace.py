"""A node group that vanishes keeps its nodes' models, for a grace period.

Deleting a LocalModelNodeGroup, even for a moment (``kubectl replace --force``, a GitOps prune
and re-apply, a rename done as delete + create), must not delete every model and partial
download on its nodes. KServe's controller stops reconciling a cache whose group is missing
and leaves the LocalModelNodes alone; so, by default, do we: while a cache still lists a group
that does not exist, the entries its nodes have for that group stay (and so do the serving
volumes of that group). With a grace period (``--missing-group-grace``) they are dropped once
the group has been missing that long; the cache's NodeGroupNotFound condition says why meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from modelcache.kube.informer import DELETED
from modelcache.kube.objects import meta


class MissingGroups:
    def __init__(self, grace: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        #: Seconds a missing group's entries are kept; None: until the group returns (KServe).
        self.grace = grace
        self._clock = clock
        self._since: dict[str, float] = {}  # group -> when we first saw it missing
        self._lock = threading.Lock()

    def observe(self, event: str, obj: dict[str, Any], _old: dict[str, Any] | None) -> None:
        """The node-group informer's handler: a deletion starts the clock, a (re)creation stops it."""
        name = meta(obj).name
        with self._lock:
            if event == DELETED:
                self._since.setdefault(name, self._clock())
            else:
                self._since.pop(name, None)

    def keep(self, group: str, exists: bool) -> bool:
        """Whether entries of ``group`` are kept although their nodes are not members now."""
        if exists:
            return False  # the group is there: membership decides
        if self.grace is None:
            return True
        with self._lock:
            since = self._since.setdefault(group, self._clock())  # missing since we started, at least
        return self._clock() - since < self.grace

    def recheck_after(self) -> float | None:
        """Seconds until the next grace period ends (None: none is running out)."""
        if self.grace is None:
            return None
        now = self._clock()
        with self._lock:
            left = [since + self.grace - now for since in self._since.values()]
        pending = [t for t in left if t > 0]
        return min(pending) + 0.05 if pending else None


class GoneNodes:
    """A deleted Node keeps its LocalModelNode for a grace period, in case it registers again.

    The LocalModelNode is the only record of which entries a node had: the entries a vanished
    group's nodes keep (MissingGroups) are kept because they are on it. Deleted at once, a Node
    deleted and registered again (``kubectl delete node`` and a kubelet restart) while one of its
    groups is missing for a moment (a GitOps prune) got a fresh LocalModelNode without that
    group's entries, and its agent deleted those models (tests/test_chaos.py found it). Meanwhile
    nothing of the LocalModelNode changes: there is no Node to compute its entries for.
    """

    def __init__(self, grace: float = 15.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace = grace
        self._clock = clock
        self._since: dict[str, float] = {}  # node -> when we first saw it gone
        self._lock = threading.Lock()

    def left(self, node: str) -> float:
        """Seconds until the gone Node's LocalModelNode may be deleted (0: now)."""
        with self._lock:
            since = self._since.setdefault(node, self._clock())  # gone since we first looked, at least
        return max(0.0, since + self.grace - self._clock())

    def forget(self, node: str) -> None:
        """The Node is there (again), or its LocalModelNode is gone: the next absence starts anew."""
        with self._lock:
            self._since.pop(node, None)
