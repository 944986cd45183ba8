"""A typed view of any Kubernetes object's metadata, and the one spelling of a namespaced key.

Objects stay the dicts the API server sent (informers hand out and cache those); ``meta(obj)``
reads their ``metadata`` once into a frozen ``Meta`` (kopf's ``bodies.Meta``), so code says
``meta(obj).labels`` instead of ``(obj.get("metadata") or {}).get("labels") or {}``.
``namespaced_key`` is client-go's ``MetaNamespaceKeyFunc``: ``namespace/name``, or ``name`` for a
cluster-scoped object; an informer's store key, a cache's key and a ``modelStatus`` key of a
namespace cache are all this one key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def namespaced_key(namespace: str | None, name: str) -> str:
    """``namespace/name``; ``name`` alone when there is no namespace (cluster-scoped)."""
    return f"{namespace}/{name}" if namespace else name


@dataclass(frozen=True)
class Meta:
    """What code reads of an object's ``metadata``; missing fields read as empty, never KeyError."""

    name: str = ""
    namespace: str | None = None
    uid: str = ""
    generation: int = 0
    resource_version: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    deletion_timestamp: str | None = None
    finalizers: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return namespaced_key(self.namespace, self.name)

    @property
    def deleting(self) -> bool:
        return self.deletion_timestamp is not None


def meta(obj: Mapping[str, Any] | None) -> Meta:
    """The metadata of ``obj`` (None or a dict without metadata: an empty view)."""
    raw = (obj or {}).get("metadata") or {}
    return Meta(name=str(raw.get("name") or ""), namespace=raw.get("namespace") or None, uid=str(raw.get("uid") or ""),
                generation=int(raw.get("generation") or 0), resource_version=str(raw.get("resourceVersion") or ""),
                labels=dict(raw.get("labels") or {}), annotations=dict(raw.get("annotations") or {}),
                deletion_timestamp=raw.get("deletionTimestamp") or None,
                finalizers=tuple(raw.get("finalizers") or ()))
