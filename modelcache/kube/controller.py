"""Level-triggered controllers: informers feed keys into a work queue, workers reconcile keys.

A reconciler gets a key (``name`` or ``namespace/name``), reads the current state (usually
from informer caches), makes the world match the desired state, and returns a
:class:`Result`. It must be idempotent: the same key may be reconciled any number of times,
but never by two workers at once (the queue guarantees that). An exception requeues the key
with per-key exponential backoff; success resets the backoff.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from modelcache.kube.informer import Informer, object_key, wait_for_all
from modelcache.kube.leader import LeaderElector
from modelcache.kube.objects import meta, namespaced_key
from modelcache.kube.predicates import Predicate
from modelcache.kube.workqueue import ExponentialBackoff, ShutDown, WorkQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """What to do with the key after a successful reconcile."""

    #: Reconcile again after this many seconds (periodic checks, waiting on something external).
    requeue_after: float | None = None
    #: Reconcile again soon, with backoff (progress made but not finished).
    requeue: bool = False


Reconciler = Callable[[str], Result | None]
#: Maps an informer event to the keys to reconcile: mapper(event_type, obj, old) -> keys.
Mapper = Callable[[str, dict[str, Any], dict[str, Any] | None], Iterable[str]]


def own_key(_event: str, obj: dict[str, Any], _old: dict[str, Any] | None) -> list[str]:
    return [object_key(obj)]


def owner_keys(kind: str, owner_namespaced: bool = False, controller_only: bool = True) -> Mapper:
    """Map an owned object (a PV, a PVC) to its owner's key via ``metadata.ownerReferences``.

    A namespaced owner lives in its dependent's namespace (Kubernetes forbids cross-namespace
    owners), so its key is ``<namespace>/<name>``; a cluster-scoped owner's key is its name.
    """

    def mapper(_event: str, obj: dict[str, Any], _old: dict[str, Any] | None) -> list[str]:
        m = meta(obj)
        ns = m.namespace if owner_namespaced else None
        return [namespaced_key(ns, ref["name"]) for ref in m.owner_references
                if ref.get("kind") == kind and (ref.get("controller") or not controller_only)]

    return mapper


def label_keys(label: str, namespace_label: str | None = None) -> Mapper:
    """Map an object to the key named by its label value (old and new, so a relabel reaches both).

    With ``namespace_label`` the key is ``<that label's value>/<label value>`` (a namespaced owner).
    """

    def one(obj: dict[str, Any] | None) -> list[str]:
        labels = meta(obj).labels
        name = labels.get(label)
        if not name:
            return []
        if namespace_label is None:
            return [name]
        ns = labels.get(namespace_label)
        return [namespaced_key(ns, name)] if ns else []

    def mapper(_event: str, obj: dict[str, Any], old: dict[str, Any] | None) -> list[str]:
        return sorted(set(one(obj)) | set(one(old)))

    return mapper


def generation_or_meta_changed(event: str, obj: dict[str, Any], old: dict[str, Any] | None) -> bool:
    """Skip updates that change only status (controller-runtime's GenerationChangedPredicate,
    plus labels/annotations/deletion, which do not bump the generation)."""
    if event != "MODIFIED" or old is None:
        return True
    m, o = meta(obj), meta(old)
    return ((m.generation, m.labels, m.annotations, m.deletion_timestamp, m.finalizers)
            != (o.generation, o.labels, o.annotations, o.deletion_timestamp, o.finalizers))


class Controller:
    def __init__(
        self,
        name: str,
        reconcile: Reconciler,
        workers: int = 2,
        backoff: ExponentialBackoff | None = None,
    ) -> None:
        self.name = name
        self.reconcile = reconcile
        self.workers = workers
        self.queue = WorkQueue(backoff or ExponentialBackoff(base=0.05, cap=300.0))
        self.informers: list[Informer] = []
        self._threads: list[threading.Thread] = []
        #: Checked before every reconcile (set by the Manager): False holds the keys back (for
        #: ``gate_retry`` seconds at a time) instead of acting on a view that may be stale.
        self.gate: Callable[[], bool] | None = None
        self.gate_retry = 0.5
        #: Reconciles held back by the gate (for tests and metrics).
        self.deferred = 0

    def watch(self, informer: Informer, mapper: Mapper = own_key, predicate: Predicate | None = None) -> Controller:
        """Enqueue ``mapper(event)`` keys for every event of ``informer`` that passes ``predicate``."""

        def handler(event: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
            if predicate is not None and not predicate(event, obj, old):
                return
            for key in mapper(event, obj, old):
                self.queue.add(key)

        informer.add_handler(handler)
        if informer not in self.informers:
            self.informers.append(informer)
        return self

    def start(self, wait_sync: float = 60.0) -> Controller:
        """Start workers once every watched informer has synced (a reconcile must not see a
        half-filled cache and, say, delete what it has not loaded yet)."""
        if not wait_for_all(self.informers, wait_sync):
            raise TimeoutError(f"controller {self.name}: informers did not sync in {wait_sync}s")
        for i in range(self.workers):
            t = threading.Thread(target=self._worker, name=f"{self.name}-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.queue.shutdown()
        for t in self._threads:
            t.join(timeout)

    def _worker(self) -> None:
        while True:
            try:
                key = self.queue.get()
            except ShutDown:
                return
            if key is None:
                continue
            try:
                self.process(str(key))
            finally:
                self.queue.done(key)

    def process(self, key: str) -> None:
        if self.gate is not None and not self.gate():
            self.deferred += 1
            self.queue.add_after(key, self.gate_retry)
            return
        try:
            result = self.reconcile(key) or Result()
        except Exception as exc:
            delay = self.queue.add_rate_limited(key)
            log.warning(
                "%s: reconcile %s failed (%s: %s); retry in %.2fs", self.name, key, type(exc).__name__, exc, delay
            )
            return
        if result.requeue_after is not None:
            self.queue.forget(key)
            self.queue.add_after(key, result.requeue_after)
        elif result.requeue:
            self.queue.add_rate_limited(key)
        else:
            self.queue.forget(key)


class Manager:
    """Runs informers and controllers, optionally only while holding a leader Lease.

    As controller-runtime does, informers start at once (a standby's caches are warm when it
    takes over), controllers start when leadership is acquired, and losing leadership ends
    :meth:`run` with False: the process should exit and be restarted rather than try to
    un-start reconcilers that may be mid-write.
    """

    def __init__(self) -> None:
        self.informers: list[Informer] = []
        self.controllers: list[Controller] = []
        self._controllers_started = threading.Event()

    def add(self, controller: Controller) -> Controller:
        self.controllers.append(controller)
        for inf in controller.informers:
            if inf not in self.informers:
                self.informers.append(inf)
        return controller

    @property
    def controllers_running(self) -> bool:
        return self._controllers_started.is_set()

    def start_informers(self) -> None:
        for inf in self.informers:
            if not inf.started:
                inf.start()

    def start_controllers(self, wait_sync: float = 60.0, gate: Callable[[], bool] | None = None) -> None:
        """Start every controller; ``gate`` (if any) must hold before each reconcile."""
        for c in self.controllers:
            c.gate = gate
            c.start(wait_sync)
        self._controllers_started.set()

    def run(self, stop: threading.Event, elector: LeaderElector | None = None, wait_sync: float = 60.0) -> bool:
        """Block until ``stop`` is set; returns False if leadership was lost before that."""
        lost = threading.Event()
        self.start_informers()
        try:
            if elector is None:
                self.start_controllers(wait_sync)
            else:
                elector.on_started_leading = lambda: self.start_controllers(wait_sync, gate=elector.holds)

                def stopped() -> None:
                    if not stop.is_set():
                        lost.set()
                        stop.set()

                elector.on_stopped_leading = stopped
                elector.start()
            stop.wait()
        finally:
            self.shutdown(elector)
        return not lost.is_set()

    def shutdown(self, elector: LeaderElector | None = None) -> None:
        for c in self.controllers:
            c.stop()
        if elector is not None:
            elector.stop()  # releases the Lease after our workers have stopped writing
        for inf in self.informers:
            inf.stop()
