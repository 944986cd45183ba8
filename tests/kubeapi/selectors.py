"""Label selectors (=, ==, !=, in, notin, exists, !exists) and field selectors (=, ==, !=)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.kubeapi.errors import ApiError, bad_request

_TOKEN = re.compile(r"\s*(!=|==|=|!|\(|\)|,|[^\s!=(),]+)")
_LABEL_KEY = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # = != in notin exists !exists
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        has = self.key in labels
        if self.op == "exists":
            return has
        if self.op == "!exists":
            return not has
        if self.op in ("=", "in"):
            return has and labels[self.key] in self.values
        # != and notin match objects without the label, as in the real API
        return not has or labels[self.key] not in self.values


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            break
        out.append(m.group(1))
        pos = m.end()
    if text[pos:].strip():
        raise bad_request(f"unable to parse requirement: {text!r}")
    return out


def parse_label_selector(text: str | None) -> list[Requirement]:
    if not text or not text.strip():
        return []
    toks = _tokens(text)
    reqs: list[Requirement] = []
    i = 0

    def fail(why: str) -> ApiError:
        return bad_request(f"unable to parse requirement: {why}")

    while i < len(toks):
        neg = toks[i] == "!"
        if neg:
            i += 1
        if i >= len(toks):
            raise fail("missing key")
        key = toks[i]
        if not _LABEL_KEY.match(key):
            raise fail(f"invalid label key {key!r}")
        i += 1
        nxt = toks[i] if i < len(toks) else ","
        if neg:
            reqs.append(Requirement(key, "!exists"))
        elif nxt == ",":
            reqs.append(Requirement(key, "exists"))
        elif nxt in ("=", "==", "!="):
            if i + 1 >= len(toks) or toks[i + 1] in (",", "(", ")"):
                value = ""
                i += 1
            else:
                value = toks[i + 1]
                i += 2
            reqs.append(Requirement(key, "!=" if nxt == "!=" else "=", (value,)))
        elif nxt in ("in", "notin"):
            if i + 1 >= len(toks) or toks[i + 1] != "(":
                raise fail(f"expected '(' after {nxt}")
            i += 2
            values: list[str] = []
            while i < len(toks) and toks[i] != ")":
                if toks[i] != ",":
                    values.append(toks[i])
                i += 1
            if i >= len(toks):
                raise fail("missing ')'")
            i += 1
            reqs.append(Requirement(key, nxt, tuple(values)))
        else:
            raise fail(f"unexpected {nxt!r}")
        if i < len(toks):
            if toks[i] != ",":
                raise fail(f"expected ',' got {toks[i]!r}")
            i += 1
    return reqs


def labels_match(reqs: list[Requirement], obj: dict[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


def _field_value(obj: dict[str, Any], path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def parse_field_selector(text: str | None, allowed: frozenset[str]) -> Callable[[dict[str, Any]], bool]:
    if not text or not text.strip():
        return lambda obj: True
    terms: list[tuple[str, bool, str]] = []
    for part in text.split(","):
        m = re.match(r"^\s*([^!=\s]+)\s*(!=|==|=)\s*(.*?)\s*$", part)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        field, op, value = m.groups()
        if field not in allowed:
            raise bad_request(f'field label not supported: {field}')
        terms.append((field, op == "!=", value))
    return lambda obj: all((_field_value(obj, f) == v) != neg for f, neg, v in terms)
