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
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from modelcache.kube.client import Kube, Resource
from modelcache.kube.objects import meta

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


def _conflict(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 409


def _retry_on_conflict(what: str, attempt: Callable[[], Any], retries: int) -> Any:
    """``attempt()`` until it does not conflict, at most ``retries`` times (10 ms doubling to 500 ms
    between); a 404 means the object was deleted meanwhile: nothing left to write (None)."""
    def once() -> Any:
        try:
            return attempt()
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    retrying = Retrying(retry=retry_if_exception(_conflict), stop=stop_after_attempt(retries),
                        wait=wait_exponential(multiplier=0.01, max=0.5), reraise=True,
                        before_sleep=lambda rs: log.debug("%s: conflict, retrying (%d)", what, rs.attempt_number))
    return retrying(once)


class _Fresh:
    """The object an attempt starts from: the caller's copy (say, from an informer cache) the
    first time, and after a conflict the object read again."""

    def __init__(self, kube: Kube, res: Resource, name: str, namespace: str | None,
                 current: dict[str, Any] | None) -> None:
        self.kube, self.res, self.name, self.namespace = kube, res, name, namespace
        self._first = current

    def take(self) -> dict[str, Any] | None:
        """The object to compute from (None: it is gone)."""
        obj, self._first = self._first, None
        return obj if obj is not None else self.kube.get_or_none(self.res, self.name, self.namespace)


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
    fresh = _Fresh(kube, res, name, namespace, current)

    def attempt() -> dict[str, Any] | None:
        obj = fresh.take()
        if obj is None:
            return None
        old_status = obj.get("status") or {}
        new_status = desired(copy.deepcopy(obj))
        patch = merge_patch(old_status, new_status)
        if not patch:
            return None
        body = {"metadata": {"resourceVersion": meta(obj).resource_version}, "status": patch}
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
    fresh = _Fresh(kube, res, name, namespace, current)

    def attempt() -> dict[str, Any] | None:
        obj = fresh.take()
        if obj is None:
            return None
        before = copy.deepcopy(obj)
        mutate(obj)
        if obj == before:
            return None
        return kube.replace(res, obj, namespace)

    return _retry_on_conflict(f"{res.plural}/{name}", attempt, retries)
