"""Writing objects safely: only on change, and retried on conflicts.

Controllers compute the desired status from scratch on every reconcile. Writing it every
time would bump ``resourceVersion``, wake every watcher and, for our own objects, trigger
another reconcile: so we compare first and send nothing when nothing changed. When we do
write, the patch carries the ``resourceVersion`` we computed from, so a concurrent writer
makes the server answer 409 and we recompute from the fresh object instead of clobbering it.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from modelcache.kube.client import Kube, Resource

log = logging.getLogger(__name__)

#: Raised after this many conflicts in a row (client-go's DefaultRetry has 5 steps).
CONFLICT_RETRIES = 5


def merge_patch(old: Any, new: Any) -> Any:
    """The RFC 7386 JSON merge patch that turns ``old`` into ``new`` (``{}`` when equal)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = copy.deepcopy(value)
        elif old[key] != value:
            if isinstance(old[key], dict) and isinstance(value, dict):
                sub = merge_patch(old[key], value)
                if sub:
                    patch[key] = sub
            else:
                patch[key] = copy.deepcopy(value)
    return patch


def _retry_on_conflict(what: str, attempt: Callable[[], Any], retries: int) -> Any:
    for n in range(retries):
        try:
            return attempt()
        except ApiException as exc:
            if exc.status == 404:
                return None  # deleted meanwhile: nothing left to write
            if exc.status != 409 or n == retries - 1:
                raise
            log.debug("%s: conflict, retrying (%d)", what, n + 1)
            time.sleep(min(0.01 * 2**n, 0.5))
    raise AssertionError("unreachable")


def patch_status_if_changed(
    kube: Kube,
    res: Resource,
    name: str,
    desired: Callable[[dict[str, Any]], dict[str, Any]],
    namespace: str | None = None,
    current: dict[str, Any] | None = None,
    retries: int = CONFLICT_RETRIES,
) -> dict[str, Any] | None:
    """Set ``status`` to ``desired(obj)`` if that differs from the object's status.

    ``desired`` gets the current object and returns the whole new status; it is called again
    with the fresh object after a conflict. ``current`` (e.g. from an informer cache) saves
    the first GET. Returns the written object, or None when nothing needed writing (or the
    object is gone).
    """
    state = {"obj": current}

    def attempt() -> dict[str, Any] | None:
        obj = state["obj"]
        state["obj"] = None  # after a conflict, read the fresh object
        if obj is None:
            obj = kube.get_or_none(res, name, namespace)
            if obj is None:
                return None
        old_status = obj.get("status") or {}
        new_status = desired(copy.deepcopy(obj))
        patch = merge_patch(old_status, new_status)
        if not patch:
            return None
        body = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "status": patch}
        return kube.patch_status(res, name, body, namespace)

    return _retry_on_conflict(f"{res.plural}/{name} status", attempt, retries)


def update_if_changed(
    kube: Kube,
    res: Resource,
    name: str,
    mutate: Callable[[dict[str, Any]], None],
    namespace: str | None = None,
    current: dict[str, Any] | None = None,
    retries: int = CONFLICT_RETRIES,
) -> dict[str, Any] | None:
    """GET, ``mutate(obj)`` in place, and PUT only if something changed; 409 re-reads and retries.

    For spec/metadata edits (finalizers, labels, ``spec.localModels``). Returns the written
    object, or None when nothing changed or the object is gone.
    """
    state = {"obj": current}

    def attempt() -> dict[str, Any] | None:
        obj = state["obj"]
        state["obj"] = None
        if obj is None:
            obj = kube.get_or_none(res, name, namespace)
            if obj is None:
                return None
        before = copy.deepcopy(obj)
        mutate(obj)
        if obj == before:
            return None
        return kube.replace(res, obj, namespace)

    return _retry_on_conflict(f"{res.plural}/{name}", attempt, retries)
