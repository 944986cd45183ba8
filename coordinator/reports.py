"""Which of an agent's reports the coordinator believes: only those for the current entry and
the current Node.

A LocalModelNode's status can be older than its spec or its Node: a cache re-created under the
same name with another URI while the agent was down still shows the old model's
``ModelDownloaded``; a Node replaced by a new machine under the same name while the coordinator
was down keeps the old machine's LocalModelNode. Labels placed from such a status send serving
pods to a folder that is not there. So a reported state counts only when
- the agent's ``modelDetails`` for the entry name the storageKey of the entry's URI (the agent
  writes both in the same patch), and
- ``status.nodeUID`` (the uid of the Node the agent read) is the uid of the Node that exists now.
Without these fields (KServe's agent writes neither) the plain ``modelStatus`` is taken as it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from modelcache.kube.objects import meta
from modelcache.kube.views import LocalModelNodeView
from modelcache.sources.uri import storage_key


def node_uid(node: Mapping[str, Any] | None) -> str | None:
    return meta(node).uid or None


def reported_state(lmn: Mapping[str, Any] | None, uid: str | None, skey: str, uri: str) -> str | None:
    """``modelStatus[skey]`` of ``lmn`` if it was reported for ``uri`` on the Node with ``uid``; else None."""
    view = LocalModelNodeView(lmn)
    state = view.model_status.get(skey)
    if not state:
        return None
    reported_for = view.node_uid
    if reported_for and uid and reported_for != uid:
        return None  # written on a machine that has since been replaced under the same name
    detail = view.detail(skey)
    if detail.get("storageKey") and detail["storageKey"] != storage_key(uri):
        return None  # about another URI that an entry of this name had before
    return str(state)


def reported_message(lmn: Mapping[str, Any] | None, skey: str) -> str:
    """What the agent said about ``skey`` (its ``modelDetails`` message: the reason of an error)."""
    detail = LocalModelNodeView(lmn).detail(skey)
    # Without the agent's retry count: the cache's condition changes when the reason does, not
    # at every retry of the same failure.
    return _RETRY.sub("", " ".join(str(detail.get("message") or "").split()))


_RETRY = re.compile(r" \(retry \d+ in [^)]*\)$")


def reported_verification(lmn: Mapping[str, Any] | None, uid: str | None, skey: str, uri: str) -> str | None:
    """``Verifying`` / ``Unverified`` while the agent counts a copy KServe's agent downloaded on its
    word (``modelDetails[skey].verification``, agent/state.py); None once verified, or not reported."""
    if reported_state(lmn, uid, skey, uri) is None:
        return None
    value = LocalModelNodeView(lmn).detail(skey).get("verification")
    return str(value) if value else None
