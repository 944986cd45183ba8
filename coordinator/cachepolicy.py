"""What a cache's spec may not ask for, whoever writes it (checked by the cache webhook, CREATE
and spec UPDATE; docs/operations.md, "Threat model"):

- no credentials in ``sourceModelUri`` (userinfo, a presigned or SAS signature, a token): the URI
  is copied into every member's LocalModelNode (which every agent reads), into a download Job's
  arguments, and its storage key (a hash of the raw URI) is published as a Node label, where
  anyone who reads Nodes could test guessed passwords against it. Credentials go in a Secret of
  the credential namespace (docs/install.md#credentials).
- a LocalModelNamespaceCache sets no ``storage.parameters`` that send the credentials it names to
  another endpoint or accept any certificate for it (agent/credentials.py, where the agent also
  checks that the credentials are granted to the cache's namespace);
- and its namespace's caches declare no more than the namespace's share of a node group (by
  default half its storageLimit: modelcache/kube/share.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from modelcache.kube.quantity import parse_quantity
from modelcache.kube.share import namespace_share, share_advice
from modelcache.kube.views import CacheView
from modelcache.runtime.progress import human_bytes
from modelcache.runtime.redact import credentials_in
from modelcache.sources.credentials import REDIRECTING_PARAMETERS, redirecting


def refusal(kind: str, name: str, spec: Mapping[str, Any], namespaced: bool) -> str | None:
    """Why the cache's spec is refused, as one line naming the field and the fix; None: fine."""
    uri = str(spec.get("sourceModelUri") or "")
    if found := credentials_in(uri):
        return (f"{kind} {name}: sourceModelUri carries credentials ({', '.join(found)}); a cache's URI is "
                "copied to every node's LocalModelNode and its storage key published as a Node label: put the "
                "credentials in a Secret of the credential namespace and name it with storage.key or "
                "serviceAccountName")
    params = (spec.get("storage") or {}).get("parameters") or {}
    if namespaced and (bad := redirecting(params)):
        return (f"{kind} {name}: storage.parameters may not set {', '.join(bad)} in a namespace cache (any of "
                f"{', '.join(REDIRECTING_PARAMETERS)} would send the credentials it names elsewhere); set them in "
                "the storage-config key a cluster admin granted to this namespace")
    return None


def share_refusal(name: str, namespace: str, spec: Mapping[str, Any], neighbours: list[dict[str, Any]],
                  group: Callable[[str], dict[str, Any] | None]) -> str | None:
    """Why a LocalModelNamespaceCache's declared ``modelSize`` does not fit its namespace's share of
    a node group (half its storageLimit unless the group's annotation
    modelcache.io/namespace-storage-limit says otherwise: modelcache/kube/share.py), counting the
    namespace's other caches of that group once per URI; the agent enforces the same share on
    the bytes it really writes."""
    size = parse_quantity(spec.get("modelSize")) or 0
    uri = str(spec.get("sourceModelUri") or "")  # as CacheView reads the neighbours' below
    for group_name in spec.get("nodeGroups") or []:
        obj = group(group_name)
        share = namespace_share(obj) if obj is not None else None
        if share is None or share.limit is None:
            continue
        sizes = {uri: size}
        for other in neighbours:
            theirs = CacheView(other)
            if theirs.meta.name == name or theirs.meta.deleting or group_name not in theirs.node_groups:
                continue
            sizes.setdefault(theirs.source_model_uri, parse_quantity(theirs.model_size) or 0)
        total = sum(sizes.values())
        if total > share.limit:
            return (f"LocalModelNamespaceCache {namespace}/{name}: namespace {namespace}'s caches would declare "
                    f"{human_bytes(total)} (modelSize) on node group {group_name}, over its share of "
                    f"{human_bytes(share.limit)} per node ({share.source}); {share_advice(namespace)}")
    return None
