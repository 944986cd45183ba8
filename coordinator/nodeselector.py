"""Kubernetes node-selector semantics (``MatchNodeSelectorTerms``) and node readiness.

A node group's members are the nodes its PV's ``nodeAffinity.required`` selects, so this must
match what the scheduler does for that PV: terms are ORed, the expressions (and fields) inside
one term are ANDed, an empty term matches nothing, and an empty term list matches nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from modelcache.kube.objects import meta
from modelcache.kube.views import NodeView

Node = Mapping[str, Any]


def _as_int(value: str) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _in(present: bool, value: str | None, values: list[str]) -> bool:
    return present and value in values


def _gt_lt(present: bool, value: str | None, values: list[str], greater: bool) -> bool:
    # Gt/Lt take exactly one integer value; a non-integer label or argument never matches.
    if not present or len(values) != 1:
        return False
    have, want = _as_int(value or ""), _as_int(values[0])
    if have is None or want is None:
        return False
    return have > want if greater else have < want


#: operator -> test(label_present, label_value, values)
OPERATORS: dict[str, Callable[[bool, str | None, list[str]], bool]] = {
    "In": _in,
    "NotIn": lambda present, value, values: not _in(present, value, values),
    "Exists": lambda present, _value, _values: present,
    "DoesNotExist": lambda present, _value, _values: not present,
    "Gt": lambda present, value, values: _gt_lt(present, value, values, True),
    "Lt": lambda present, value, values: _gt_lt(present, value, values, False),
}

#: Fields a ``matchFields`` requirement may name (the scheduler supports only this one).
NODE_FIELDS: dict[str, Callable[[Node], str | None]] = {
    "metadata.name": lambda node: meta(node).name or None,
}


def match_requirement(req: Mapping[str, Any], values_of: Mapping[str, str]) -> bool:
    op = OPERATORS.get(str(req.get("operator")))
    if op is None:
        return False  # an unknown operator is invalid: the API server would reject it; never match
    key = str(req.get("key", ""))
    present = key in values_of
    return op(present, values_of.get(key), [str(v) for v in req.get("values") or []])


def match_term(term: Mapping[str, Any], node: Node) -> bool:
    exprs = list(term.get("matchExpressions") or [])
    fields = list(term.get("matchFields") or [])
    if not exprs and not fields:
        return False  # the scheduler: an empty term selects no objects
    labels = meta(node).labels
    if not all(match_requirement(r, labels) for r in exprs):
        return False
    node_fields = {}
    for req in fields:
        getter = NODE_FIELDS.get(str(req.get("key")))
        if getter is None:
            return False
        value = getter(node)
        if value is not None:
            node_fields[str(req["key"])] = value
    return all(match_requirement(r, node_fields) for r in fields)


def match_node_selector_terms(terms: list[Mapping[str, Any]] | None, node: Node) -> bool:
    """True if any term selects ``node`` (ORed); no terms select no node."""
    return any(match_term(t, node) for t in terms or [])


def node_ready(node: Node) -> bool:
    """``Ready=True`` among the node's conditions (a node with no such condition is not ready)."""
    return NodeView(node).ready
