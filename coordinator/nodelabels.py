"""The node label that says "this model is complete on this node", for pod placement.

Scheme: ``downloaded.modelcache.io/<storageKey>: "true"`` on a node whose agent reports
``ModelDownloaded`` for some LocalModelNode entry with that source URI (reported for that URI
and that Node: coordinator.reports). ``storageKey`` is
KServe's folder name (sha256 of the raw URI, 16 hex chars): the label names exactly the folder
a serving pod mounts, so caches sharing a URI share the label. The coordinator owns every label
under the prefix: stale ones (model deleted, download failed, node left the group) are removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.reports import reported_state
from modelcache.kube.objects import meta
from modelcache.kube.types import MODEL_DOWNLOADED
from modelcache.kube.views import LocalModelNodeView
from modelcache.sources.uri import storage_key

LABEL_PREFIX = "downloaded.modelcache.io/"
LABEL_VALUE = "true"


def model_label(source_uri: str) -> str:
    return LABEL_PREFIX + storage_key(source_uri)


def downloaded_labels(lmn: Mapping[str, Any] | None, node_uid: str | None = None) -> set[str]:
    """Labels the node should carry, from its LocalModelNode: entries its agent reported
    ModelDownloaded for that entry's URI on this Node (``node_uid``; see coordinator.reports)."""
    if not lmn:
        return set()
    out = set()
    for entry in LocalModelNodeView(lmn).entries:
        uri = entry.source_model_uri
        if uri and reported_state(lmn, node_uid, entry.key, uri) == MODEL_DOWNLOADED:
            out.add(model_label(uri))
    return out


def label_patch(node: Mapping[str, Any], wanted: set[str]) -> dict[str, Any]:
    """Merge patch bringing the node's prefixed labels to ``wanted`` ({} when already there)."""
    labels = meta(node).labels
    have = {k for k, v in labels.items() if k.startswith(LABEL_PREFIX)}
    diff: dict[str, str | None] = {k: None for k in have - wanted}
    diff.update({k: LABEL_VALUE for k in wanted if labels.get(k) != LABEL_VALUE})
    return {"metadata": {"labels": diff}} if diff else {}
