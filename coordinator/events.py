"""Kubernetes Events on caches (``kubectl describe`` shows them): copies gained and lost.

Cluster-scoped objects get their events in ``default``, as client-go's recorder does.
Failures to record are logged and never fail a reconcile.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
from collections.abc import Mapping
from typing import Any

from modelcache.kube.client import EVENTS, Kube

log = logging.getLogger(__name__)

COMPONENT = "modelcache-coordinator"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_body(obj: Mapping[str, Any], reason: str, message: str, type_: str, instance: str) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace") or "default"
    involved = {"apiVersion": obj.get("apiVersion", ""), "kind": obj.get("kind", ""), "name": meta.get("name", ""),
                "uid": meta.get("uid", ""), "resourceVersion": meta.get("resourceVersion", "")}
    if meta.get("namespace"):
        involved["namespace"] = meta["namespace"]
    now = _now()
    return {
        "metadata": {"generateName": f"{meta.get('name', 'object')}.", "namespace": ns},
        "involvedObject": involved, "reason": reason, "message": message, "type": type_,
        "source": {"component": COMPONENT}, "reportingComponent": COMPONENT, "reportingInstance": instance,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }


class EventRecorder:
    def __init__(self, kube: Kube, instance: str | None = None) -> None:
        self.kube = kube
        self.instance = instance or socket.gethostname()

    def record(self, obj: Mapping[str, Any], reason: str, message: str, type_: str = "Normal") -> None:
        body = event_body(obj, reason, message, type_, self.instance)
        try:
            self.kube.create(EVENTS, body, body["metadata"]["namespace"])
        except Exception as exc:
            log.warning("event %s on %s not recorded: %s", reason, (obj.get("metadata") or {}).get("name"), exc)
