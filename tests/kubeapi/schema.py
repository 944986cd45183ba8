"""Structural-schema handling for custom resources, in kube-apiserver's order: prune, default,
validate (openAPIV3Schema subset: type, properties, additionalProperties, items, required, enum,
min/maxItems, min/maxLength, minimum/maximum, pattern, int-or-string, nullable) and the CEL
transition rules KServe uses (`self == oldSelf`)."""

from __future__ import annotations

import copy
import re
import sys
from functools import lru_cache
from typing import Any

from tests.kubeapi.errors import FieldError

_ROOT_KEEP = ("apiVersion", "kind", "metadata")
_META_FIELDS = frozenset((
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation", "creationTimestamp",
    "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations", "ownerReferences", "finalizers",
    "managedFields",
))
_warned: set[str] = set()


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _preserves(schema: dict[str, Any]) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def prune(schema: dict[str, Any], obj: Any, root: bool = False, path: str = "",
          dropped: list[str] | None = None) -> Any:
    """Drop fields the schema doesn't know (unless preserved; their paths go to `dropped`) and nulls
    on non-nullable fields."""
    dropped = [] if dropped is None else dropped
    if isinstance(obj, dict):
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if root and k in _ROOT_KEEP:
                if k == "metadata" and isinstance(v, dict):
                    dropped.extend(f"metadata.{m}" for m in v if m not in _META_FIELDS)
                    v = {m: mv for m, mv in v.items() if m in _META_FIELDS}
                out[k] = v
                continue
            sub: dict[str, Any] | None = None
            if props and k in props:
                sub = props[k]
            elif isinstance(addl, dict):
                sub = addl
            elif addl is True or _preserves(schema) or (props is None and schema.get("type") != "object"):
                out[k] = v
                continue
            if sub is None:
                dropped.append(_join(path, k))
                continue
            if v is None and not sub.get("nullable"):
                continue
            out[k] = prune(sub, v, path=_join(path, k), dropped=dropped)
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [prune(schema["items"], v, path=f"{path}[{i}]", dropped=dropped) for i, v in enumerate(obj)]
    return obj


def apply_defaults(schema: dict[str, Any], obj: Any) -> None:
    if isinstance(obj, dict):
        for k, sub in (schema.get("properties") or {}).items():
            if k not in obj and "default" in sub:
                obj[k] = copy.deepcopy(sub["default"])
            if k in obj:
                apply_defaults(sub, obj[k])
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            for k, v in obj.items():
                if k not in (schema.get("properties") or {}):
                    apply_defaults(addl, v)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for v in obj:
            apply_defaults(schema["items"], v)


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _type_ok(want: str, value: Any) -> bool:
    got = _type_name(value)
    return got == want or (want == "number" and got == "integer") or (
        want == "integer" and isinstance(value, float) and value.is_integer())


@lru_cache(maxsize=256)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def validate(schema: dict[str, Any], obj: Any, path: str = "") -> list[FieldError]:
    errs: list[FieldError] = []
    if obj is None:
        return errs
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(obj, (int, str)) or isinstance(obj, bool):
            errs.append(FieldError(path, "Invalid value", _type_name(obj),
                                   f"{path} in body must be of type integer,string: {_q(_type_name(obj))}"))
            return errs
    elif "type" in schema and not _type_ok(schema["type"], obj):
        errs.append(FieldError(path, "Invalid value", _type_name(obj),
                               f"{path} in body must be of type {schema['type']}: {_q(_type_name(obj))}"))
        return errs
    if "enum" in schema and obj not in schema["enum"]:
        supported = ", ".join(_q(str(e)) if isinstance(e, str) else str(e) for e in schema["enum"])
        errs.append(FieldError(path, "Unsupported value", obj, f"supported values: {supported}"))
    if isinstance(obj, str):
        if "pattern" in schema and not _regex(schema["pattern"]).search(obj):
            errs.append(FieldError(path, "Invalid value", obj, f"{path} in body should match '{schema['pattern']}'"))
        if "maxLength" in schema and len(obj) > schema["maxLength"]:
            errs.append(FieldError(path, "Too long", obj,
                                   f"may not be more than {schema['maxLength']} bytes"))
        if "minLength" in schema and len(obj) < schema["minLength"]:
            errs.append(FieldError(path, "Invalid value", obj,
                                   f"{path} in body should be at least {schema['minLength']} chars long"))
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        if "minimum" in schema and obj < schema["minimum"]:
            errs.append(FieldError(path, "Invalid value", obj,
                                   f"{path} in body should be greater than or equal to {schema['minimum']}"))
        if "maximum" in schema and obj > schema["maximum"]:
            errs.append(FieldError(path, "Invalid value", obj,
                                   f"{path} in body should be less than or equal to {schema['maximum']}"))
    if isinstance(obj, list):
        if "minItems" in schema and len(obj) < schema["minItems"]:
            errs.append(FieldError(path, "Invalid value", len(obj),
                                   f"{path} in body should have at least {schema['minItems']} items"))
        if "maxItems" in schema and len(obj) > schema["maxItems"]:
            errs.append(FieldError(path, "Too many", len(obj), f"must have at most {schema['maxItems']} items"))
        items = schema.get("items")
        if isinstance(items, dict):
            for i, v in enumerate(obj):
                errs.extend(validate(items, v, f"{path}[{i}]"))
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        for req in schema.get("required") or []:
            if req not in obj:
                errs.append(FieldError(_join(path, req), "Required value"))
        addl = schema.get("additionalProperties")
        for k, v in obj.items():
            if not path and k in _ROOT_KEEP:
                continue
            if k in props:
                errs.extend(validate(props[k], v, _join(path, k)))
            elif isinstance(addl, dict):
                errs.extend(validate(addl, v, _join(path, k)))
    return errs


def _q(s: str) -> str:
    return '"' + s + '"'


# CEL rules we can evaluate; the key is the rule text as KServe writes it. Rules we can't
# evaluate are ignored (with one warning) rather than guessed.
def _rule_self_eq_old(new: Any, old: Any) -> bool:
    return bool(new == old)


_TRANSITION_RULES = {"self == oldSelf": _rule_self_eq_old}


def validate_transitions(schema: dict[str, Any], new: Any, old: Any, path: str = "") -> list[FieldError]:
    """x-kubernetes-validations that reference oldSelf, checked where both old and new have a value."""
    errs: list[FieldError] = []
    if new is None or old is None:
        return errs
    for rule in schema.get("x-kubernetes-validations") or []:
        text = " ".join(str(rule.get("rule", "")).split())
        if "oldSelf" not in text:
            continue
        fn = _TRANSITION_RULES.get(text)
        if fn is None:
            if text not in _warned:
                _warned.add(text)
                print(f"kubeapi: CEL rule not supported, ignored: {text}", file=sys.stderr)
            continue
        if not fn(new, old):
            errs.append(FieldError(path, "Invalid value", _type_name(new), rule.get("message") or
                                   f"failed rule: {text}"))
    if isinstance(new, dict) and isinstance(old, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for k, v in new.items():
            sub = props.get(k) or (addl if isinstance(addl, dict) else None)
            if sub is not None and k in old:
                errs.extend(validate_transitions(sub, v, old[k], _join(path, k)))
    return errs


def admit(schema: dict[str, Any], obj: dict[str, Any],
          old: dict[str, Any] | None) -> tuple[dict[str, Any], list[FieldError], list[str]]:
    """Prune, default and validate `obj` (and its transition from `old`) for a custom resource.
    Returns the stored object, the validation errors and the paths of pruned unknown fields."""
    unknown: list[str] = []
    pruned = prune(schema, obj, root=True, dropped=unknown)
    apply_defaults(schema, pruned)
    errs = validate(schema, pruned)
    if old is not None:
        errs.extend(validate_transitions(schema, pruned, old))
    return pruned, errs, unknown
