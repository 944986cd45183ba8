"""Uninstall without a hang: release our finalizers when our namespace is deleted.

``kubectl delete -k deploy/`` deletes our namespace first (kustomize orders Namespaces first),
then the CRDs, RBAC and webhooks in the same breath. Deleting a CRD deletes every cache, and a
cache carrying our finalizer waits for the coordinator to clean up; but the coordinator's pods die
with the namespace and its RBAC goes at once, so nothing would ever remove the finalizer and the
CRD (and kubectl) would wait forever. So the webhook for the namespace's DELETE, admitted while
everything still works, does the cleanup the finalizer stands for (our serving PVs and PVCs) and
removes the finalizer from every cache, marking each with :data:`RELEASED_ANNOTATION` (the
namespace's uid) so the leader does not put it back in the moments before it stops. A later
install (a new namespace, a new uid) adds the finalizers again.

Failure policy Ignore: with the coordinator down the namespace is deleted anyway and the
finalizers stay; docs/operations.md says how to remove them by hand.
"""

from __future__ import annotations

import logging
import threading
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


def release(kube: Kube, install_uid: str) -> int:
    """Delete our serving volumes and release our finalizer from every cache; returns how many
    caches were released. Best effort per object: one failure does not stop the others."""
    volumes: dict[str, list[tuple[Any, str, str | None]]] = {}
    for res in (PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES):
        for item in kube.list(res, None, label_selector=MANAGED_SELECTOR).get("items") or []:
            owner = cache_of(item)
            if owner is not None:
                m = meta(item)
                volumes.setdefault(cache_key(*owner), []).append((res, m.name, m.namespace))
    released = 0
    for res, finalizer in ((LOCAL_MODEL_CACHES, CACHE_FINALIZER),
                           (LOCAL_MODEL_NAMESPACE_CACHES, NAMESPACE_CACHE_FINALIZER)):
        for cache in kube.list(res).get("items") or []:
            cm = meta(cache)
            if finalizer not in cm.finalizers:
                continue
            ns = cm.namespace
            for vres, name, vns in volumes.get(cm.key, []):
                try:
                    kube.delete(vres, name, vns)
                except ApiException as exc:
                    log.warning("uninstall: deleting %s %s failed: %s", vres.kind, name, error_message(exc))

            def drop(o: dict[str, Any], finalizer: str = finalizer) -> None:
                m = o["metadata"]  # an edit of the object written back: the dict, not a view
                m["finalizers"] = [f for f in m.get("finalizers") or [] if f != finalizer]
                m.setdefault("annotations", {})[RELEASED_ANNOTATION] = install_uid

            try:
                update_if_changed(kube, res, cm.name, drop, ns, current=cache)
                released += 1
            except ApiException as exc:
                log.warning("uninstall: releasing %s %s failed: %s", res.kind, cm.key, error_message(exc))
    return released


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
