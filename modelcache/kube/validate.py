"""A LocalModelNode checked before the agent acts on it: as the API server checks it, and more.

The agent deletes every model its spec does not list, so a spec it misreads (an entry with
KServe's InferenceService keys ``name``/``storageUri``, a typo in ``sourceModelUri``) would cost
every model on the node. Such a spec is refused whole, before anything on disk changes: each
problem is one line naming the field, as ``kubectl apply`` (strict field validation) names it.

``SPEC_SCHEMA`` is the ``spec`` of deploy/crds/serving.kserve.io_localmodelnodes.yaml (the
tests hold the two equal): the installed agent has no deploy/ folder to read it from. Beyond
the schema: names and URIs must not be empty, and one (namespace, modelName) appears once
(both keys of ``status.modelStatus``).
"""

from __future__ import annotations

import difflib
from typing import Any

_STRING: dict[str, Any] = {"type": "string"}

SPEC_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["localModels"],
    "properties": {
        "localModels": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["modelName", "sourceModelUri"],
                "properties": {
                    "modelName": _STRING,
                    "sourceModelUri": _STRING,
                    "namespace": _STRING,
                    "nodeGroup": _STRING,
                    "serviceAccountName": _STRING,
                    "storage": {
                        "type": "object",
                        "properties": {
                            "key": _STRING,
                            "parameters": {"type": "object", "additionalProperties": _STRING},
                        },
                    },
                    "imagePullSecrets": {
                        "type": "array",
                        "maxItems": 1,
                        "items": {"type": "object", "properties": {"name": {"type": "string", "default": ""}}},
                    },
                },
            },
        },
    },
}

#: Top-level keys of the object itself (``status`` is ignored: the agent writes its own).
_OBJECT_KEYS = ("apiVersion", "kind", "metadata", "spec", "status")
API_VERSION = "serving.kserve.io/v1alpha1"

#: Keys people bring from an InferenceService or a LocalModelCache, and what a LocalModelNode
#: entry calls them.
_KNOWN_MIXUPS = {"storageUri": "sourceModelUri", "name": "modelName", "uri": "sourceModelUri",
                 "sourceUri": "sourceModelUri", "modelUri": "sourceModelUri", "nodeGroups": "nodeGroup"}

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,), "integer": (int,),
    "number": (int, float),
}


def _type_ok(value: Any, want: str) -> bool:
    if want in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES.get(want, (object,)))


def _hint(name: str, known: list[str]) -> str:
    if name in _KNOWN_MIXUPS and _KNOWN_MIXUPS[name] in known:
        return f' (a LocalModelNode entry calls it "{_KNOWN_MIXUPS[name]}")'
    close = difflib.get_close_matches(name, known, n=1)
    return f' (did you mean "{close[0]}"?)' if close else f" (known: {', '.join(known)})"


def schema_problems(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """What the API server's structural-schema validation would refuse, one line each.

    ``null`` counts as absent (the API server drops null fields that are not nullable)."""
    want = schema.get("type")
    if want and not _type_ok(value, want):
        return [f"{path}: must be {'an' if want[0] in 'aeiou' else 'a'} {want}, not {type(value).__name__}"]
    out: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, dict):
        props: dict[str, Any] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name in schema.get("required") or ():
            if value.get(name) is None:
                out.append(f'{path}: missing required field "{name}"')
        for name, sub in value.items():
            if sub is None:
                continue
            if name in props:
                out.extend(schema_problems(sub, props[name], f"{path}.{name}"))
            elif isinstance(extra, dict):
                out.extend(schema_problems(sub, extra, f"{path}.{name}"))
            elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f'{path}: unknown field "{name}"{_hint(str(name), sorted(props))}')
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{path}: at most {schema['maxItems']} item(s), got {len(value)}")
        items = schema.get("items")
        if items:
            for i, item in enumerate(value):
                out.extend(schema_problems(item, items, f"{path}[{i}]"))
    return out


def spec_problems(spec: Any) -> list[str]:
    """Problems of a LocalModelNode ``spec``: the CRD's schema, then what the agent needs."""
    out = schema_problems(spec, SPEC_SCHEMA, "spec")
    if out:
        return out
    seen: dict[tuple[str, str], int] = {}
    for i, entry in enumerate(spec.get("localModels") or []):
        where = f"spec.localModels[{i}]"
        for name in ("modelName", "sourceModelUri"):
            if not str(entry.get(name, "")).strip():
                out.append(f'{where}: "{name}" is empty')
        key = (entry.get("namespace") or "", entry.get("modelName") or "")
        if key[1] and key in seen:
            ns = f" in namespace {key[0]!r}" if key[0] else ""
            out.append(f"{where}: modelName {key[1]!r}{ns} is listed twice (also spec.localModels[{seen[key]}]); "
                       "each model has one status entry")
        seen.setdefault(key, i)
    return out


def node_problems(obj: Any) -> list[str]:
    """Problems of a whole LocalModelNode document (a standalone file, or one from the API)."""
    if not isinstance(obj, dict):
        return [f"the document must be a mapping, not {type(obj).__name__}"]
    out = []
    if obj.get("apiVersion") not in (None, API_VERSION):
        out.append(f"apiVersion: {obj['apiVersion']!r} is not {API_VERSION}")
    for name in obj:
        if name not in _OBJECT_KEYS:
            out.append(f'unknown field "{name}"{_hint(str(name), list(_OBJECT_KEYS))}')
    if obj.get("spec") is None:
        out.append('missing required field "spec" (with its list "localModels")')
    else:
        out.extend(spec_problems(obj["spec"]))
    return out
