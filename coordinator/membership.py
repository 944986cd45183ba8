"""Which nodes a cache lives on: node-group membership from the group PV's node affinity.

A node is a member of a group when the group's ``persistentVolumeSpec.nodeAffinity.required``
selects it; members that are Ready hold the cache, members that are not show ``NodeNotReady``.
With overlapping groups, a node belongs to the *first* of the cache's groups that selects it
(KServe picks whichever group its map iteration visits last; we are deterministic).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.nodeselector import match_node_selector_terms, node_ready
from modelcache.kube.objects import meta


def group_terms(group: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    pv = (group.get("spec") or {}).get("persistentVolumeSpec") or {}
    required = (pv.get("nodeAffinity") or {}).get("required") or {}
    return list(required.get("nodeSelectorTerms") or [])


def group_matches(group: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """No ``nodeAffinity.required`` means no members (as KServe)."""
    return match_node_selector_terms(group_terms(group), node)


@dataclass(frozen=True)
class Member:
    node: str
    group: str
    ready: bool


def place(
    cache_groups: Iterable[str], groups: Mapping[str, Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]]
) -> dict[str, Member]:
    """node name -> Member, over the cache's groups that exist (missing groups have no members)."""
    existing = [(g, groups[g]) for g in cache_groups if g in groups]
    out: dict[str, Member] = {}
    for node in nodes:
        name = meta(node).name
        for gname, group in existing:
            if group_matches(group, node):
                out[name] = Member(name, gname, node_ready(node))
                break
    return out

