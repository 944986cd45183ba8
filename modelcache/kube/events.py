"""Kubernetes Events (core/v1) about our objects: what ``kubectl describe`` shows a user.

Repeats of the same (object, reason, message) within one process bump ``count`` and
``lastTimestamp`` on the existing Event instead of creating a new one, as client-go's
recorder does, so a model that fails every minute does not flood the namespace.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

from kubernetes.client.exceptions import ApiException

from modelcache.kube.client import EVENTS, Kube
from modelcache.kube.objects import meta
from modelcache.runtime.clock import rfc3339

log = logging.getLogger(__name__)

NORMAL = "Normal"
WARNING = "Warning"
#: Where Events about cluster-scoped objects (LocalModelNode, LocalModelCache) go, as kubectl expects.
CLUSTER_EVENTS_NAMESPACE = "default"


class EventRecorder:
    def __init__(self, kube: Kube, component: str, host: str | None = None) -> None:
        self.kube = kube
        self.component = component
        self.host = host
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[str, int]] = {}  # dedup key -> (event name, count)

    def record(self, obj: dict[str, Any], event_type: str, reason: str, message: str) -> None:
        """Best effort: a failure to record an Event is logged, never raised."""
        m = meta(obj)
        namespace = m.namespace or CLUSTER_EVENTS_NAMESPACE
        message = message[:1024]
        key = "\x00".join((obj.get("kind", ""), namespace, m.name, m.uid, reason, message))
        try:
            with self._lock:
                seen = self._seen.get(key)
            if seen is not None:
                name, count = seen
                self.kube.patch(EVENTS, name, {"count": count + 1, "lastTimestamp": rfc3339()}, namespace)
                with self._lock:
                    self._seen[key] = (name, count + 1)
                return
            digest = hashlib.sha256(key.encode()).hexdigest()[:10]
            name = f"{m.name or 'object'}.{digest}"[:253]
            now = rfc3339()
            try:
                self.kube.create(EVENTS, {
                    "metadata": {"name": name, "namespace": namespace},
                    "involvedObject": {
                        # An absent field is sent as null, as before (never as "").
                        "apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": m.name or None,
                        "namespace": m.namespace, "uid": m.uid or None, "resourceVersion": m.resource_version or None,
                    },
                    "type": event_type,
                    "reason": reason,
                    "message": message,
                    "count": 1,
                    "firstTimestamp": now,
                    "lastTimestamp": now,
                    "source": {"component": self.component, **({"host": self.host} if self.host else {})},
                    "reportingComponent": self.component,
                    "reportingInstance": self.host or self.component,
                }, namespace)
                count = 1
            except ApiException as exc:
                if exc.status != 409:
                    raise
                # Recorded before a restart (the name is a digest of the event): count it again.
                existing = self.kube.get(EVENTS, name, namespace)
                count = int(existing.get("count") or 1) + 1
                self.kube.patch(EVENTS, name, {"count": count, "lastTimestamp": now}, namespace)
            with self._lock:
                self._seen[key] = (name, count)
        except Exception as exc:
            log.warning("could not record event %s on %s: %s", reason, m.name, type(exc).__name__)
            with self._lock:
                self._seen.pop(key, None)
