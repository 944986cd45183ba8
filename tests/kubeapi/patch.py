"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and a strategic-merge subset
(merge lists of objects by their merge key, honour `$patch: delete|replace`, drop `$` directives)."""

from __future__ import annotations

import copy
from typing import Any

from tests.kubeapi.errors import ApiError

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"

# Merge keys of the core lists kubectl's strategic patches touch most (containers, env, ports, volumes...).
_MERGE_KEYS = ("name", "containerPort", "mountPath", "devicePath", "type", "ip", "port")


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _merge_key(items: list[Any]) -> str | None:
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    for key in _MERGE_KEYS:
        if all(key in i for i in items):
            return key
    return None


def strategic_merge(target: Any, patch: Any) -> Any:
    if isinstance(patch, dict):
        if patch.get("$patch") == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
        out = copy.deepcopy(target) if isinstance(target, dict) else {}
        for k, v in patch.items():
            if k.startswith("$"):
                continue  # $setElementOrder/..., $retainKeys, $deleteFromPrimitiveList/...: ordering hints
            if v is None:
                out.pop(k, None)
            elif isinstance(v, list) and isinstance(out.get(k), list):
                out[k] = _merge_list(out[k], v)
            else:
                out[k] = strategic_merge(out.get(k), v)
        return out
    if isinstance(patch, list):
        return [strategic_merge(None, v) for v in patch]
    return copy.deepcopy(patch)


def _merge_list(current: list[Any], patch: list[Any]) -> list[Any]:
    key = _merge_key([*current, *[p for p in patch if not (isinstance(p, dict) and "$patch" in p and len(p) == 1)]])
    if key is None:
        return [strategic_merge(None, v) for v in patch]
    out = copy.deepcopy(current)
    for item in patch:
        idx = next((i for i, cur in enumerate(out) if cur.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                out.pop(idx)
        elif idx is None:
            out.append(strategic_merge(None, item))
        else:
            out[idx] = strategic_merge(out[idx], item)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise _patch_error(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _patch_error(msg: str) -> ApiError:
    return ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: {msg}")


def _parent(doc: Any, parts: list[str]) -> Any:
    cur = doc
    for p in parts[:-1]:
        if isinstance(cur, list):
            try:
                cur = cur[int(p)]
            except (ValueError, IndexError) as exc:
                raise _patch_error(f"path not found: {p}") from exc
        elif isinstance(cur, dict) and p in cur:
            cur = cur[p]
        else:
            raise _patch_error(f"doc is missing path: {p}")
    return cur


def _get(doc: Any, parts: list[str]) -> Any:
    if not parts:
        return doc
    parent = _parent(doc, parts)
    last = parts[-1]
    try:
        return parent[int(last)] if isinstance(parent, list) else parent[last]
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        raise _patch_error(f"path not found: {last}") from exc


def _remove(doc: Any, parts: list[str]) -> Any:
    parent = _parent(doc, parts)
    last = parts[-1]
    try:
        return parent.pop(int(last)) if isinstance(parent, list) else parent.pop(last)
    except (KeyError, ValueError, IndexError) as exc:
        raise _patch_error(f"unable to remove nonexistent key: {last}") from exc


def _add(doc: Any, parts: list[str], value: Any, replace: bool = False) -> Any:
    if not parts:
        return value
    parent = _parent(doc, parts)
    last = parts[-1]
    if isinstance(parent, list):
        if last == "-":
            parent.append(value)
        else:
            try:
                i = int(last)
            except ValueError as exc:
                raise _patch_error(f"invalid index {last}") from exc
            if replace:
                if not 0 <= i < len(parent):
                    raise _patch_error(f"index out of range: {i}")
                parent[i] = value
            else:
                if not 0 <= i <= len(parent):
                    raise _patch_error(f"index out of range: {i}")
                parent.insert(i, value)
    elif isinstance(parent, dict):
        if replace and last not in parent:
            raise _patch_error(f"replace operation does not apply: doc is missing key: {last}")
        parent[last] = value
    else:
        raise _patch_error(f"cannot add to {type(parent).__name__}")
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(target)
    for op in ops:
        kind = op.get("op")
        parts = _pointer(op.get("path", ""))
        if kind == "add":
            doc = _add(doc, parts, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            _remove(doc, parts)
        elif kind == "replace":
            doc = _add(doc, parts, copy.deepcopy(op.get("value")), replace=True)
        elif kind == "move":
            value = _remove(doc, _pointer(op["from"]))
            doc = _add(doc, parts, value)
        elif kind == "copy":
            doc = _add(doc, parts, copy.deepcopy(_get(doc, _pointer(op["from"]))))
        elif kind == "test":
            if _get(doc, parts) != op.get("value"):
                raise _patch_error(f"testing value {op.get('path')} failed")
        else:
            raise _patch_error(f"unexpected kind: {kind}")
    return doc
