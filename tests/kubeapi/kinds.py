"""Per-kind behaviour of the built-in kinds, as registries keyed by (group, plural): write-time
defaulting (Secret stringData, CRD status), update rules the real API enforces on kinds we use
(PVC and Pod spec immutability), and CRD registration as CRD objects come and go."""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tests.kubeapi.clock import now_rfc3339
from tests.kubeapi.errors import FieldError, invalid
from tests.kubeapi.resources import CRD_TYPE, ResourceType

if TYPE_CHECKING:
    from tests.kubeapi.store import Store

Obj = dict[str, Any]
Key = tuple[str, str]


def _secret_string_data(rt: ResourceType, obj: Obj, old: Obj | None) -> Obj:
    """stringData is write-only sugar merged into base64 data."""
    string_data = obj.pop("stringData", None) or {}
    if string_data:
        data = obj.get("data") or {}
        obj["data"] = data
        for k, v in string_data.items():
            data[k] = base64.b64encode(str(v).encode()).decode()
    return obj


def _without(spec: Any, drop: Callable[[Obj], None]) -> Any:
    spec = copy.deepcopy(spec) if isinstance(spec, dict) else {}
    drop(spec)
    return spec


def _pvc_mutable(spec: Obj) -> None:
    (spec.get("resources") or {}).pop("requests", None)
    spec.pop("volumeAttributesClassName", None)


def _pvc_immutable_spec(rt: ResourceType, obj: Obj, old: Obj | None) -> Obj:
    if old is None:
        return obj
    new_spec, old_spec = obj.get("spec") or {}, old.get("spec") or {}
    if not old_spec.get("volumeName") and new_spec.get("volumeName"):
        old_spec = {**old_spec, "volumeName": new_spec["volumeName"]}  # binding sets volumeName once
    if _without(new_spec, _pvc_mutable) != _without(old_spec, _pvc_mutable):
        raise invalid(rt, obj["metadata"]["name"], [FieldError(
            "spec", "Forbidden", detail="spec is immutable after creation except resources.requests and "
            "volumeAttributesClassName for bound claims")])
    return obj


def _pod_mutable(spec: Obj) -> None:
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            c.pop("image", None)
    for key in ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds", "schedulingGates"):
        spec.pop(key, None)


def _pod_immutable_spec(rt: ResourceType, obj: Obj, old: Obj | None) -> Obj:
    if old is not None and _without(obj.get("spec"), _pod_mutable) != _without(old.get("spec"), _pod_mutable):
        raise invalid(rt, obj["metadata"]["name"], [FieldError(
            "spec", "Forbidden", detail="pod updates may not change fields other than `spec.containers[*].image`,"
            "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to "
            "existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
            "previously negative)")])
    return obj


def _crd_defaults(rt: ResourceType, obj: Obj, old: Obj | None) -> Obj:
    spec = obj.get("spec") or {}
    names = spec.get("names") or {}
    name = (obj.get("metadata") or {}).get("name", "")
    if not spec.get("group") or not names.get("plural") or not names.get("kind") or not spec.get("versions"):
        raise invalid(CRD_TYPE, name, [FieldError(
            "spec", "Required value", detail="group, names.plural, names.kind and versions are required")])
    if name != f"{names['plural']}.{spec['group']}":
        raise invalid(CRD_TYPE, name, [FieldError("metadata.name", "Invalid value", name,
                                                  'must be spec.names.plural+"."+spec.group')])
    accepted = {**names, "singular": names.get("singular") or names["kind"].lower(),
                "listKind": names.get("listKind") or names["kind"] + "List"}
    if (obj.get("status") or {}).get("acceptedNames") == accepted:
        return obj  # unchanged names: keep the conditions, so a re-apply is a no-op
    obj["status"] = {
        "acceptedNames": accepted,
        "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
        "conditions": [
            {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": now_rfc3339()}
            for t, r, m in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                            ("Established", "InitialNamesAccepted", "the initial names have been accepted"))
        ],
    }
    return obj


def _crd_registered(store: Store, crd: Obj) -> None:
    store.registry.register_crd(crd)


def _crd_removed(store: Store, crd: Obj) -> None:
    """Deleting a CRD deletes every object of its kind, then its endpoints disappear."""
    spec = crd.get("spec") or {}
    key = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
    types = store.registry.unregister_crd(crd["metadata"]["name"])
    store.drop_bucket(key, types[0] if types else None)


_BEFORE_WRITE: dict[Key, Callable[[ResourceType, Obj, Obj | None], Obj]] = {
    ("", "secrets"): _secret_string_data,
    ("", "persistentvolumeclaims"): _pvc_immutable_spec,
    ("", "pods"): _pod_immutable_spec,
    CRD_TYPE.key: _crd_defaults,
}
_AFTER_WRITE: dict[Key, Callable[[Store, Obj], None]] = {CRD_TYPE.key: _crd_registered}
_AFTER_REMOVE: dict[Key, Callable[[Store, Obj], None]] = {CRD_TYPE.key: _crd_removed}


def before_write(rt: ResourceType, obj: Obj, old: Obj | None) -> Obj:
    hook = _BEFORE_WRITE.get(rt.key)
    return hook(rt, obj, old) if hook else obj


def after_write(store: Store, rt: ResourceType, obj: Obj) -> None:
    hook = _AFTER_WRITE.get(rt.key)
    if hook:
        hook(store, obj)


def after_remove(store: Store, rt: ResourceType, obj: Obj) -> None:
    hook = _AFTER_REMOVE.get(rt.key)
    if hook:
        hook(store, obj)
