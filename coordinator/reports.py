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
from dataclasses import dataclass
from typing import Any

from modelcache.kube.objects import meta
from modelcache.kube.views import LocalModelNodeView
from modelcache.sources.uri import storage_key


def node_uid(node: Mapping[str, Any] | None) -> str | None:
    return meta(node).uid or None


_RETRY = re.compile(r" \(retry \d+ in [^)]*\)$")


@dataclass(frozen=True)
class Report:
    """What an agent reported about one entry, as believed: ``state`` None when the report is
    not about the current Node and URI (then ``verification`` is None too)."""

    state: str | None
    #: The agent's message for the entry (an error's reason), without its retry count.
    message: str
    #: ``Verifying`` / ``Unverified`` while a copy is counted on KServe's word; None once verified.
    verification: str | None


def report_of(lmn: Mapping[str, Any] | None, uid: str | None, skey: str, uri_key: str) -> Report:
    """The report of entry ``skey`` on ``lmn``, believed only if written for the Node with ``uid``
    and the URI whose storage key is ``uri_key`` (``storage_key(uri)``, computed once by a caller
    that asks for many nodes: a cache's status asks for each of its 1,000 members)."""
    view = LocalModelNodeView(lmn)
    detail = view.detail(skey)
    # Without the agent's retry count: the cache's condition changes when the reason does, not
    # at every retry of the same failure.
    message = _RETRY.sub("", " ".join(str(detail.get("message") or "").split()))
    state = view.model_status.get(skey)
    reported_for = view.node_uid
    if not state or (reported_for and uid and reported_for != uid):
        return Report(None, message, None)  # none, or written on a machine since replaced under the same name
    if detail.get("storageKey") and detail["storageKey"] != uri_key:
        return Report(None, message, None)  # about another URI that an entry of this name had before
    verification = detail.get("verification")
    return Report(str(state), message, str(verification) if verification else None)


def reported_state(lmn: Mapping[str, Any] | None, uid: str | None, skey: str, uri: str) -> str | None:
    """``modelStatus[skey]`` of ``lmn`` if it was reported for ``uri`` on the Node with ``uid``; else None."""
    return report_of(lmn, uid, skey, storage_key(uri)).state

