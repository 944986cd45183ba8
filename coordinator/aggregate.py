"""Cache status from what the agents report: ``nodeStatus`` and ``copies``.

Counted over the cache's *current* members only: a node that was deleted or left the group
leaves ``nodeStatus`` and stops counting (KServe keeps such nodes forever, kserve#6159). A
member that is not Ready is ``NodeNotReady`` whatever its agent last said, because its copy
cannot serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.membership import Member
from modelcache.kube.types import (
    NODE_DOWNLOAD_ERROR,
    NODE_DOWNLOAD_PENDING,
    NODE_DOWNLOADED,
    NODE_NOT_READY,
    NODE_STATE_FOR_MODEL_STATE,
)


@dataclass(frozen=True)
class Copies:
    available: int = 0
    total: int = 0
    failed: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"available": self.available, "total": self.total, "failed": self.failed}


def node_state(model_state: str | None) -> str:
    """KServe's mapping; a model the agent has not reported yet (or ``""``) is pending."""
    return NODE_STATE_FOR_MODEL_STATE.get(model_state or "", NODE_DOWNLOAD_PENDING)


def node_status(members: Mapping[str, Member], model_states: Mapping[str, str | None]) -> dict[str, str]:
    """node -> Node* state; ``model_states`` is each node's ``modelStatus[statusKey]`` (None if absent)."""
    return {
        name: node_state(model_states.get(name)) if m.ready else NODE_NOT_READY
        for name, m in sorted(members.items())
    }


def copies(status: Mapping[str, str]) -> Copies:
    states = list(status.values())
    return Copies(states.count(NODE_DOWNLOADED), len(states), states.count(NODE_DOWNLOAD_ERROR))


def copy_changes(old: Mapping[str, str], new: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(nodes that gained a usable copy, nodes that lost one) between two nodeStatus maps."""
    gained = sorted(n for n, s in new.items() if s == NODE_DOWNLOADED and old.get(n) != NODE_DOWNLOADED)
    lost = sorted(n for n, s in old.items() if s == NODE_DOWNLOADED and new.get(n) != NODE_DOWNLOADED)
    return gained, lost


def set_condition(conditions: list[dict[str, Any]], type_: str, status: bool, reason: str, message: str,
                  now: str) -> list[dict[str, Any]]:
    """``conditions`` with ``type_`` set; an unchanged condition keeps its ``lastTransitionTime``
    (so a reconcile that changes nothing writes nothing)."""
    value = "True" if status else "False"
    out = [dict(c) for c in conditions if c.get("type") != type_]
    old = next((c for c in conditions if c.get("type") == type_), None)
    if old is not None and (old.get("status"), old.get("reason"), old.get("message")) == (value, reason, message):
        new = dict(old)
    else:
        new = {"type": type_, "status": value, "reason": reason, "message": message, "lastTransitionTime": now}
    return sorted([*out, new], key=lambda c: str(c.get("type")))
