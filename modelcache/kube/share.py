"""A namespace's share of a node group: the most bytes the LocalModelNamespaceCaches of one
namespace may hold on each node of a LocalModelNodeGroup (security review M4: without one, a
single tenant's cache fills the group's storageLimit and the cluster admin's caches no longer fit).

By default a namespace gets half the group's ``storageLimit``; the group's annotation
``modelcache.io/namespace-storage-limit`` sets another quantity, or ``none`` for no per-namespace
share (KServe's behaviour; cluster caches still come first: agent/capacity.py). Read the same way
by the cache webhook (declared ``modelSize``) and by the agent (the bytes it really writes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modelcache.kube.objects import meta
from modelcache.kube.quantity import parse_quantity
from modelcache.kube.types import NAMESPACE_LIMIT_ANNOTATION
from modelcache.runtime.progress import human_bytes

#: The annotation's value that turns the per-namespace share off.
NO_SHARE = "none"
#: The default share: storageLimit // DEFAULT_DIVISOR (half: one namespace can never take more
#: than the room it leaves everyone else, the cluster admin's caches included).
DEFAULT_DIVISOR = 2


@dataclass(frozen=True)
class Share:
    """A namespace's share in bytes (None: no share) and where it comes from, for messages."""

    limit: int | None
    source: str
    #: The annotation's value when it is not a quantity (the default share applies meanwhile).
    invalid: str = ""


def namespace_share(group: Mapping[str, Any] | None) -> Share:
    """The per-namespace share of a LocalModelNodeGroup object."""
    spec = (group or {}).get("spec") or {}
    raw = str(meta(group).annotations.get(NAMESPACE_LIMIT_ANNOTATION) or "").strip()
    if raw.lower() == NO_SHARE:
        return Share(None, f"{NAMESPACE_LIMIT_ANNOTATION}={NO_SHARE}")
    if raw and (value := parse_quantity(raw)) is not None:
        return Share(value, f"the group's annotation {NAMESPACE_LIMIT_ANNOTATION}")
    limit = parse_quantity(spec.get("storageLimit"))
    if limit is None:
        return Share(None, "no storageLimit", invalid=raw)
    return Share(limit // DEFAULT_DIVISOR,
                 f"the default: half the group's storageLimit of {human_bytes(limit)}", invalid=raw)


def share_advice(namespace: str) -> str:
    """What the refused namespace (and its cluster admin) can do."""
    return (f"delete a LocalModelNamespaceCache of {namespace}, or ask a cluster admin to set the annotation "
            f"{NAMESPACE_LIMIT_ANNOTATION} on the LocalModelNodeGroup (a quantity per namespace and node, or "
            f"'{NO_SHARE}' for no share; docs/operations.md#threat-model)")
