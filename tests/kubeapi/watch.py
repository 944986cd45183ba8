"""Watch streams: replay from a resourceVersion (or the current state), filter by namespace and
selectors, translate selector transitions into ADDED/DELETED, send BOOKMARKs, end on timeout,
and answer a too-old version with an ERROR event carrying 410 Expired, like the real server."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.kubeapi.errors import bad_request, gone
from tests.kubeapi.resources import ResourceType
from tests.kubeapi.selectors import Requirement, labels_match
from tests.kubeapi.store import Event, Obj, Store

Emit = Callable[[dict[str, Any]], None]


@dataclass
class WatchRequest:
    rt: ResourceType
    namespace: str
    labels: list[Requirement]
    fields: Callable[[Obj], bool]
    resource_version: str | None
    timeout: float
    bookmarks: bool
    bookmark_interval: float


def _matches(req: WatchRequest, obj: Obj | None) -> bool:
    return obj is not None and labels_match(req.labels, obj) and req.fields(obj)


def _translate(req: WatchRequest, ev: Event) -> tuple[str, Obj] | None:
    if ev.key != req.rt.key or (req.namespace and ev.namespace != req.namespace):
        return None
    new_ok = _matches(req, ev.obj)
    old_ok = _matches(req, ev.old)
    if ev.type == "ADDED":
        return ("ADDED", ev.obj) if new_ok else None
    if ev.type == "DELETED":
        return ("DELETED", ev.obj) if new_ok or old_ok else None
    if new_ok and old_ok:
        return ("MODIFIED", ev.obj)
    if new_ok:
        return ("ADDED", ev.obj)
    if old_ok:
        return ("DELETED", ev.obj)
    return None


def _expired(rv: int, oldest: int) -> dict[str, Any]:
    return {"type": "ERROR", "object": gone(f"too old resource version: {rv} ({oldest + 1})").status()}


def run_watch(store: Store, req: WatchRequest, emit: Emit, to_wire: Callable[[Obj], Obj]) -> None:
    """Stream events through `emit` until timeout, a dropped-watches signal or server shutdown."""
    start = time.monotonic()
    deadline = start + req.timeout
    next_bookmark = start + req.bookmark_interval
    with store.cond:
        epoch = store.watch_epoch
        if req.resource_version in (None, "", "0"):
            initial, rv, _ = store.list(req.rt, req.namespace, req.labels, req.fields)
            last = int(rv)
        else:
            try:
                last = int(req.resource_version)
            except ValueError as exc:
                raise bad_request(f"invalid resource version: {req.resource_version!r}") from exc
            initial = []
            if last < store.compacted_rv:
                emit(_expired(last, store.compacted_rv))
                return
    for obj in initial:
        emit({"type": "ADDED", "object": to_wire(obj)})
    while True:
        with store.cond:
            while True:
                if store.closed or store.watch_epoch != epoch:
                    return
                events = store.events_after(last)
                if events is None or events:
                    break
                now = time.monotonic()
                wake = min(deadline, next_bookmark if req.bookmarks else deadline)
                if now >= wake:
                    break
                store.cond.wait(wake - now)
            if events is None:
                emit(_expired(last, store.compacted_rv))
                return
            current = store.rv
        for ev in events:
            out = _translate(req, ev)
            if out is not None:
                obj = dict(out[1])
                obj["apiVersion"] = req.rt.group_version
                emit({"type": out[0], "object": to_wire(obj)})
        last = max(last, current)
        now = time.monotonic()
        if req.bookmarks and now >= next_bookmark:
            emit({"type": "BOOKMARK", "object": {
                "kind": req.rt.kind, "apiVersion": req.rt.group_version,
                "metadata": {"resourceVersion": str(last)}}})
            next_bookmark = now + req.bookmark_interval
        if now >= deadline:
            return
