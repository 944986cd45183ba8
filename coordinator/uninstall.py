"""Uninstall without a hang: release our finalizers when our namespace is deleted.

``kubectl delete -k deploy/`` deletes our namespace first (kustomize orders Namespaces first),
then the CRDs, RBAC and webhooks in the same breath. Deleting a CRD deletes every cache, and a
cache carrying our finalizer waits for the coordinator to clean up; but the coordinator's pods die
with the namespace and its RBAC goes at once, so nothing would ever remove the finalizer and the
CRD (and kubectl) would wait forever. So the webhook for the namespace's DELETE, admitted while
everything still works, removes the finalizer from every cache, marking each with
:data:`RELEASED_ANNOTATION` (the namespace's uid) so the leader neither puts it back nor makes
volumes in the moments before it stops, and then does the cleanup the finalizer stands for (our
serving PVs and PVCs). A later install (a new namespace, a new uid) adds the finalizers again.

Failure policy Ignore: with the coordinator down the namespace is deleted anyway and the
finalizers stay; docs/operations.md says how to remove them by hand.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from coordinator.admission import Review, response
from coordinator.view import cache_key
from coordinator.volumes import MANAGED_SELECTOR, cache_of
from modelcache.kube.client import (
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    NAMESPACES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    Kube,
    error_message,
)
from modelcache.kube.objects import meta
from modelcache.kube.status import update_if_changed
from modelcache.kube.types import CACHE_FINALIZER, NAMESPACE_CACHE_FINALIZER

log = logging.getLogger(__name__)

#: On a cache whose finalizer was released for an uninstall: the uid of the namespace deleted.
RELEASED_ANNOTATION = "modelcache.io/finalizer-released"


def released_for(obj: dict[str, Any]) -> str | None:
    return meta(obj).annotations.get(RELEASED_ANNOTATION)


#: Seconds between the two passes over the serving volumes: a reconcile of the leader that read a
#: cache before our mark reached its informer may make a volume after the first pass (its create
#: follows the read within milliseconds; 2 s leaves room on a loaded API server).
SETTLE = 2.0


def release(kube: Kube, install_uid: str, settle: float = SETTLE) -> int:
    """Release our finalizer from every cache, then delete the serving volumes of those caches;
    returns how many caches were released. Best effort per object: one failure does not stop the
    others.

    The mark comes first. The leader keeps running for moments after the webhook answers, and it
    reconciles a cache whose claim it sees deleted: with the cache not yet marked it made the claim
    again, bound by name to a PV deleted a moment later, a PVC Pending for ever after the
    uninstall (seen in CI, stop 37). Marked (or gone), a cache gets nothing more from the leader
    (``CacheReconciler.uninstalling``); the second pass, ``settle`` seconds on, deletes what a
    reconcile that read the cache just before the mark had begun to make."""
    released = 0
    keys: set[str] = set()
    for res, finalizer in ((LOCAL_MODEL_CACHES, CACHE_FINALIZER),
                           (LOCAL_MODEL_NAMESPACE_CACHES, NAMESPACE_CACHE_FINALIZER)):
        for cache in kube.list(res).get("items") or []:
            cm = meta(cache)
            if finalizer not in cm.finalizers:
                if released_for(cache) == install_uid:
                    keys.add(cm.key)  # released by an earlier review of this uninstall: its volumes still go
                continue

            def drop(o: dict[str, Any], finalizer: str = finalizer) -> None:
                m = o["metadata"]  # an edit of the object written back: the dict, not a view
                m["finalizers"] = [f for f in m.get("finalizers") or [] if f != finalizer]
                m.setdefault("annotations", {})[RELEASED_ANNOTATION] = install_uid

            try:
                update_if_changed(kube, res, cm.name, drop, cm.namespace, current=cache)
            except ApiException as exc:
                log.warning("uninstall: releasing %s %s failed: %s", res.kind, cm.key, error_message(exc))
                continue  # still held: the leader may still make its volumes, so they are left to it
            released += 1
            keys.add(cm.key)
    if keys:
        _delete_volumes(kube, keys)
        time.sleep(settle)
        _delete_volumes(kube, keys)
    return released


def _delete_volumes(kube: Kube, keys: set[str]) -> None:
    """Delete our serving PVCs and PVs of the caches ``keys`` (claims first: a bound PV waits for its
    claim anyway, kubernetes.io/pv-protection)."""
    for res in (PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES):
        for item in kube.list(res, None, label_selector=MANAGED_SELECTOR).get("items") or []:
            owner, m = cache_of(item), meta(item)
            if owner is None or cache_key(*owner) not in keys or m.deleting:
                continue
            try:
                kube.delete(res, m.name, m.namespace)
            except ApiException as exc:
                if exc.status != 404:
                    log.warning("uninstall: deleting %s %s failed: %s", res.kind, m.name, error_message(exc))


@dataclass
class UninstallHook:
    """``/uninstall``: DELETE of a namespace labelled ours; acts only for ``namespace``, always allows."""

    kube: Kube
    namespace: str
    #: Seconds the admission answer waits for the release (the API server gives us 30); the
    #: release goes on after that, as long as this process lives.
    budget: float = 25.0

    def __call__(self, review: Review) -> Review:
        req = review.get("request") or {}
        if req.get("operation") != "DELETE" or req.get("name") != self.namespace or req.get("dryRun"):
            return response(review, True)
        # The uid that marks released caches is read from the API, never taken from the request.
        try:
            uid = meta(self.kube.get(NAMESPACES, self.namespace)).uid
        except ApiException as exc:
            log.warning("uninstall: cannot read namespace %s (%s): finalizers kept", self.namespace,
                        error_message(exc))
            return response(review, True)
        done: dict[str, Any] = {}

        def run() -> None:
            try:
                done["released"] = release(self.kube, uid)
            except Exception as exc:
                done["error"] = error_message(exc)
                log.exception("uninstall: releasing finalizers failed")

        worker = threading.Thread(target=run, name="uninstall-release", daemon=True)
        worker.start()
        worker.join(self.budget)
        if "released" in done:
            log.info("namespace %s is being deleted: released the finalizers of %d caches", self.namespace,
                     done["released"])
            return response(review, True, f"modelcache: released the finalizers of {done['released']} caches")
        log.warning("namespace %s is being deleted: releasing finalizers did not finish (%s)", self.namespace,
                    done.get("error", "still running"))
        return response(review, True)
