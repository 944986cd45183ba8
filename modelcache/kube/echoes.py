"""A controller's own writes coming back to it as watch events ("echoes").

A reconciler that writes an object gets back the version the API server stored; the watch event
carrying exactly that version shows the object as the reconcile left it, with nothing else
changed (any other change made before or after has a version of its own, and its own event).
Reconciling again for it computes what was just written. ``OwnWrites.not_echo`` is a predicate
(``modelcache.kube.predicates``) that lets every other event through.

Measured: the coordinator's node controller ran 6 reconciles per node to converge at 10,000 nodes
(bench/coordinator_scale.py: 60,266), two of them for its own LocalModelNode create and its own
label patch.

A reconcile of the object that starts before the echo arrives must ``forget`` it: that reconcile
may have read our informer's copy from before the write (the informer lags our own writes) and
acted on it; the echo then brings the informer up to date, and the controller must look again.
(The chaos test's label race, seed 3397273558, was a reconcile 11 ms behind our own update.)

One version is kept per object (the last we wrote): an echo that never comes (a relist shows only
the latest version) leaves one entry, replaced by our next write or dropped when the object goes.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from modelcache.kube.informer import DELETED
from modelcache.kube.objects import meta


class OwnWrites:
    """The version of each object we last wrote (one kind of object per instance)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: dict[str, str] = {}

    def wrote(self, obj: Mapping[str, Any] | None) -> None:
        """Record what the API server answered a create, update or patch with."""
        if not obj:
            return
        m = meta(obj)
        if m.name and m.resource_version:
            with self._lock:
                self._versions[m.key] = m.resource_version

    def forget(self, key: str) -> None:
        """A reconcile of ``key`` starts: the event of our last write wakes the controller again."""
        with self._lock:
            self._versions.pop(key, None)

    def not_echo(self, event: str, obj: dict[str, Any], _old: dict[str, Any] | None) -> bool:
        """False for the event of the version we wrote last (once); True for any other event."""
        m = meta(obj)
        with self._lock:
            if event == DELETED:
                self._versions.pop(m.key, None)
                return True
            if m.resource_version and self._versions.get(m.key) == m.resource_version:
                del self._versions[m.key]
                return False
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._versions)
