"""In-memory object store with kube-apiserver write semantics.

One global resourceVersion counter (every write bumps it), a bounded history of watch events
(older versions answer 410 Gone), uid/creationTimestamp/generation bookkeeping, optimistic
concurrency, the status subresource split, finalizers with deletionTimestamp, namespace
termination and background garbage collection through ownerReferences. CRD objects register
their kinds with the Registry as they are written.
"""

from __future__ import annotations

import base64
import copy
import json
import random
import re
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.kubeapi import kinds
from tests.kubeapi import patch as patches
from tests.kubeapi.clock import now_rfc3339
from tests.kubeapi.errors import ApiError, FieldError, already_exists, bad_request, conflict, invalid, not_found
from tests.kubeapi.resources import NAMESPACE_TYPE, Registry, ResourceType
from tests.kubeapi.schema import admit
from tests.kubeapi.selectors import Requirement, labels_match

Obj = dict[str, Any]
ObjKey = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped kinds
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"


@dataclass
class Event:
    rv: int
    key: tuple[str, str]  # ResourceType.key
    type: str  # ADDED | MODIFIED | DELETED
    namespace: str
    obj: Obj
    old: Obj | None


@dataclass
class DeleteOptions:
    propagation: str = "Background"  # Background | Foreground (treated as Background) | Orphan
    uid: str | None = None
    resource_version: str | None = None
    dry_run: bool = False

    @classmethod
    def from_body(cls, body: Any, query_policy: str | None, dry_run: bool = False) -> DeleteOptions:
        body = body if isinstance(body, dict) else {}
        pre = body.get("preconditions") or {}
        policy = body.get("propagationPolicy") or query_policy
        if body.get("orphanDependents") is True:
            policy = "Orphan"
        return cls(policy or "Background", pre.get("uid"), pre.get("resourceVersion"),
                   dry_run or body.get("dryRun") == ["All"])


@dataclass
class WriteOptions:
    """Per-request write options: fieldValidation (Strict | Warn | Ignore) and the warnings it produced."""

    field_validation: str = "Warn"
    dry_run: bool = False  # dryRun=All: admit and answer, store nothing
    warnings: list[str] = field(default_factory=list)


def _strip_for_generation(obj: Obj, rt: ResourceType) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("metadata", "apiVersion", "kind") and
            not (k == "status" and rt.status)}


class Store:
    def __init__(self, registry: Registry, history_limit: int = 1000) -> None:
        self.registry = registry
        self.cond = threading.Condition(threading.RLock())
        self.rv = 100
        self.objects: dict[tuple[str, str], dict[ObjKey, Obj]] = {}
        self.history: deque[Event] = deque()
        self.history_limit = history_limit
        self.compacted_rv = self.rv  # watch events at or below this version are gone
        self.watch_epoch = 0  # bumping it ends every open watch (tests: simulate dropped connections)
        self.closed = False
        self._orphan_on_remove: set[str] = set()  # uids deleted with propagationPolicy=Orphan, held by finalizers
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.create(NAMESPACE_TYPE, "", {"metadata": {"name": ns}})

    # ----- helpers ---------------------------------------------------------------------------

    def _bucket(self, rt: ResourceType) -> dict[ObjKey, Obj]:
        return self.objects.setdefault(rt.key, {})

    def _key(self, rt: ResourceType, ns: str, name: str) -> ObjKey:
        return (ns if rt.namespaced else "", name)

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _record(self, rt: ResourceType, etype: str, obj: Obj, old: Obj | None) -> None:
        meta = obj["metadata"]
        self.history.append(Event(int(meta["resourceVersion"]), rt.key, etype, meta.get("namespace", ""),
                                  copy.deepcopy(obj), copy.deepcopy(old) if old is not None else None))
        while len(self.history) > self.history_limit:
            self.compacted_rv = self.history.popleft().rv
        self.cond.notify_all()

    def _out(self, rt: ResourceType, obj: Obj) -> Obj:
        out = copy.deepcopy(obj)
        out["apiVersion"] = rt.group_version
        out["kind"] = rt.kind
        return out

    def _existing(self, rt: ResourceType, ns: str, name: str) -> Obj:
        obj = self._bucket(rt).get(self._key(rt, ns, name))
        if obj is None:
            raise not_found(rt, name)
        return obj

    def drop_bucket(self, key: tuple[str, str], rt: ResourceType | None) -> None:
        """Remove every object of a kind at once (its CRD was deleted), with DELETED events."""
        for obj in list(self.objects.pop(key, {}).values()):
            if rt is not None:
                gone = copy.deepcopy(obj)
                gone["metadata"]["resourceVersion"] = self._next_rv()
                self._record(rt, "DELETED", gone, obj)

    def compact(self) -> int:
        """Forget all watch history (tests: force 410 Gone for every older resourceVersion)."""
        with self.cond:
            self.history.clear()
            self.compacted_rv = self.rv
            return self.rv

    def drop_watches(self) -> None:
        with self.cond:
            self.watch_epoch += 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def events_after(self, rv: int) -> list[Event] | None:
        """Events newer than rv, or None when rv is older than the kept history. Hold self.cond."""
        if rv < self.compacted_rv:
            return None
        return [e for e in self.history if e.rv > rv]

    # ----- reads -----------------------------------------------------------------------------

    def get(self, rt: ResourceType, ns: str, name: str) -> Obj:
        with self.cond:
            return self._out(rt, self._existing(rt, ns, name))

    def list(self, rt: ResourceType, ns: str, labels: list[Requirement], fields: Callable[[Obj], bool],
             limit: int = 0, cont: str | None = None) -> tuple[list[Obj], str, str | None]:
        with self.cond:
            rv = str(self.rv)
            start: list[str] | None = None
            if cont:
                try:
                    token = json.loads(base64.urlsafe_b64decode(cont.encode()))
                    rv, start = token["rv"], token["start"]
                except (ValueError, KeyError) as exc:
                    raise bad_request("continue key is not valid") from exc
            keys = sorted(k for k in self._bucket(rt) if not ns or k[0] == ns)
            if start is not None:
                keys = [k for k in keys if list(k) > start]
            items: list[Obj] = []
            next_token = None
            for k in keys:
                obj = self._bucket(rt)[k]
                if not (labels_match(labels, obj) and fields(obj)):
                    continue
                if limit and len(items) >= limit:
                    last = items[-1]["metadata"]
                    next_token = base64.urlsafe_b64encode(json.dumps(
                        {"rv": rv, "start": [last.get("namespace", "") if rt.namespaced else "", last["name"]]}
                    ).encode()).decode()
                    break
                items.append(self._out(rt, obj))
            return items, rv, next_token

    # ----- writes ----------------------------------------------------------------------------

    def create(self, rt: ResourceType, ns: str, body: Any, opts: WriteOptions | None = None) -> Obj:
        opts = opts or WriteOptions()
        if not isinstance(body, dict):
            raise bad_request("the body of the request was in an unknown format")
        obj = copy.deepcopy(body)
        if obj.get("kind") not in (None, "", rt.kind):
            raise bad_request(f"the kind in the body ({obj.get('kind')}) does not match the kind of the URL "
                              f"({rt.kind})")
        obj["apiVersion"], obj["kind"] = rt.group_version, rt.kind
        meta = obj.get("metadata") or {}
        obj["metadata"] = meta
        if rt.namespaced:
            if meta.get("namespace") and meta["namespace"] != ns:
                raise bad_request("the namespace of the provided object does not match the namespace sent on the "
                                  "request")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(rt, "", [FieldError("metadata.name", "Required value",
                                                  detail="name or generateName is required")])
            meta["name"] = meta["generateName"] + "".join(random.choice(_SUFFIX_CHARS) for _ in range(5))
        name = meta["name"]
        self._check_name(rt, name)
        with self.cond:
            if rt.namespaced:
                self._check_namespace_open(ns)
            if self._key(rt, ns, name) in self._bucket(rt):
                raise already_exists(rt, name)
            if rt.status:
                if rt.initial_status:
                    obj["status"] = copy.deepcopy(rt.initial_status)
                elif rt.initial_status is not None:
                    obj.pop("status", None)
            for m in ("deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink"):
                meta.pop(m, None)
            obj = self._admit(rt, obj, None, opts)
            meta = obj["metadata"]
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            if opts.dry_run:
                return self._out(rt, obj)
            meta["resourceVersion"] = self._next_rv()
            self._bucket(rt)[self._key(rt, ns, name)] = obj
            self._record(rt, "ADDED", obj, None)
            kinds.after_write(self, rt, obj)
            return self._out(rt, obj)

    def replace(self, rt: ResourceType, ns: str, name: str, body: Any, sub: str | None,
                opts: WriteOptions | None = None) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the body of the request was in an unknown format")
        meta = body.get("metadata") or {}
        if meta.get("name") and meta["name"] != name:
            raise bad_request("the name of the object does not match the name on the URL")
        with self.cond:
            old = self._existing(rt, ns, name)
            rv = meta.get("resourceVersion")
            if not rv and rt.crd:
                raise invalid(rt, name, [FieldError("metadata.resourceVersion", "Invalid value", 0,
                                                    "must be specified for an update")])
            if rv and rv != old["metadata"]["resourceVersion"]:
                raise conflict(rt, name)
            return self._update(rt, old, copy.deepcopy(body), sub, opts or WriteOptions())

    def patch(self, rt: ResourceType, ns: str, name: str, content_type: str, body: Any, sub: str | None,
              opts: WriteOptions | None = None) -> Obj:
        opts = opts or WriteOptions()
        with self.cond:
            if content_type == patches.APPLY and self._key(rt, ns, name) not in self._bucket(rt):
                return self.create(rt, ns, {**body, "metadata": {**(body.get("metadata") or {}), "name": name}},
                                   opts)
            old = self._existing(rt, ns, name)
            current = self._out(rt, old)
            if content_type == patches.JSON_PATCH:
                new = patches.json_patch(current, body)
            elif content_type == patches.MERGE:
                new = patches.merge_patch(current, body)
            elif content_type in (patches.STRATEGIC, patches.APPLY):
                if rt.crd and content_type == patches.STRATEGIC:
                    raise ApiError(415, "UnsupportedMediaType",
                                   f"the body of the request was in an unknown format - accepted media types "
                                   f"include: {patches.JSON_PATCH}, {patches.MERGE}, {patches.APPLY}")
                new = patches.strategic_merge(current, body)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}")
            if not isinstance(new, dict):
                raise bad_request("patch did not produce an object")
            new_meta = new.get("metadata") or {}
            if new_meta.get("resourceVersion") not in (None, old["metadata"]["resourceVersion"]):
                raise conflict(rt, name)
            return self._update(rt, old, new, sub, opts)

    def _update(self, rt: ResourceType, old: Obj, body: Obj, sub: str | None,
                opts: WriteOptions | None = None) -> Obj:
        """Apply a full new object (PUT body or patched object) to `old`. Hold self.cond."""
        if sub == "status":
            new = copy.deepcopy(old)
            if "status" in body:
                new["status"] = body["status"]
            else:
                new.pop("status", None)
        else:
            new = body
            new["apiVersion"], new["kind"] = rt.group_version, rt.kind
            if rt.status:
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
        meta = new.get("metadata") or {}
        new["metadata"] = meta
        old_meta = old["metadata"]
        for m in ("name", "namespace", "uid", "creationTimestamp", "generation", "resourceVersion",
                  "deletionTimestamp", "deletionGracePeriodSeconds"):
            if m in old_meta:
                meta[m] = old_meta[m]
            else:
                meta.pop(m, None)
        meta.pop("managedFields", None)
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise invalid(rt, old_meta["name"], [FieldError(
                    "metadata.finalizers", "Forbidden", detail="no new finalizers can be added if the object is "
                    "being deleted, found new finalizers " + json.dumps(sorted(added)))])
        opts = opts or WriteOptions()
        new = self._admit(rt, new, old, opts)
        if new == old:
            return self._out(rt, old)  # a no-op write changes nothing, not even resourceVersion
        if _strip_for_generation(new, rt) != _strip_for_generation(old, rt):
            new["metadata"]["generation"] = int(old_meta.get("generation", 1)) + 1
        if opts.dry_run:
            return self._out(rt, new)
        new["metadata"]["resourceVersion"] = self._next_rv()
        key = self._key(rt, old_meta.get("namespace", ""), old_meta["name"])
        self._bucket(rt)[key] = new
        self._record(rt, "MODIFIED", new, old)
        kinds.after_write(self, rt, new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self._remove(rt, new)
        return self._out(rt, new)

    def delete(self, rt: ResourceType, ns: str, name: str, opts: DeleteOptions) -> Obj:
        """Returns the object still held by finalizers, or a Success Status once it is gone."""
        with self.cond:
            old = self._existing(rt, ns, name)
            meta = old["metadata"]
            if (opts.uid and opts.uid != meta["uid"]) or (
                    opts.resource_version and opts.resource_version != meta["resourceVersion"]):
                raise conflict(rt, name)
            if opts.dry_run:
                return self._out(rt, old) if rt.delete_returns_object else self._deleted_status(rt, old)
            if opts.propagation == "Orphan":
                self._orphan_on_remove.add(meta["uid"])
            if rt.key == NAMESPACE_TYPE.key:
                return self._delete_namespace(old)
            if meta.get("finalizers"):
                held = self._mark_deleting(rt, old)
                return held if rt.delete_returns_object else self._deleted_status(rt, held)
            self._remove(rt, old)
            return self._out(rt, old) if rt.delete_returns_object else self._deleted_status(rt, old)

    def delete_collection(self, rt: ResourceType, ns: str, labels: list[Requirement],
                          fields: Callable[[Obj], bool], opts: DeleteOptions) -> list[Obj]:
        with self.cond:
            items, _, _ = self.list(rt, ns, labels, fields)
            for item in items:
                m = item["metadata"]
                try:
                    self.delete(rt, m.get("namespace", ""), m["name"],
                                DeleteOptions(opts.propagation, dry_run=opts.dry_run))
                except ApiError:
                    pass
            return items

    def _deleted_status(self, rt: ResourceType, obj: Obj) -> Obj:
        meta = obj["metadata"]
        details: dict[str, Any] = {"name": meta["name"], "kind": rt.plural, "uid": meta["uid"]}
        if rt.group:
            details["group"] = rt.group
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}

    def _mark_deleting(self, rt: ResourceType, old: Obj) -> Obj:
        if old["metadata"].get("deletionTimestamp"):
            return self._out(rt, old)
        new = copy.deepcopy(old)
        meta = new["metadata"]
        meta["deletionTimestamp"] = now_rfc3339()
        meta["deletionGracePeriodSeconds"] = 0
        meta["generation"] = int(meta.get("generation", 1)) + 1
        meta["resourceVersion"] = self._next_rv()
        self._bucket(rt)[self._key(rt, meta.get("namespace", ""), meta["name"])] = new
        self._record(rt, "MODIFIED", new, old)
        return self._out(rt, new)

    def _remove(self, rt: ResourceType, obj: Obj) -> None:
        meta = obj["metadata"]
        key = self._key(rt, meta.get("namespace", ""), meta["name"])
        if self._bucket(rt).pop(key, None) is None:
            return
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        self._record(rt, "DELETED", gone, obj)
        kinds.after_remove(self, rt, gone)
        self._collect_garbage(meta["uid"], orphan=meta["uid"] in self._orphan_on_remove)
        self._orphan_on_remove.discard(meta["uid"])
        if rt.namespaced:
            self._maybe_finish_namespace(meta.get("namespace", ""))

    def _all_objects(self) -> list[tuple[ResourceType, Obj]]:
        types = {rt.key: rt for rt in self.registry.all()}
        return [(types[k], o) for k, bucket in self.objects.items() if k in types for o in list(bucket.values())]

    def _collect_garbage(self, owner_uid: str, orphan: bool) -> None:
        """Background GC: dependents whose owners are all gone are deleted; Orphan only unlinks them."""
        live = {o["metadata"]["uid"] for _, o in self._all_objects()}
        for rt, obj in self._all_objects():
            refs = obj["metadata"].get("ownerReferences") or []
            if not any(r.get("uid") == owner_uid for r in refs):
                continue
            remaining = [r for r in refs if r.get("uid") != owner_uid and r.get("uid") in live]
            current = self._bucket(rt).get(self._key(rt, obj["metadata"].get("namespace", ""),
                                                     obj["metadata"]["name"]))
            if current is None:
                continue
            if orphan or remaining:
                new = copy.deepcopy(current)
                if remaining:
                    new["metadata"]["ownerReferences"] = remaining
                else:
                    new["metadata"].pop("ownerReferences", None)
                self._update(rt, current, new, None)
            elif current["metadata"].get("finalizers"):
                self._mark_deleting(rt, current)
            else:
                self._remove(rt, current)

    def _delete_namespace(self, ns_obj: Obj) -> Obj:
        name = ns_obj["metadata"]["name"]
        if not ns_obj["metadata"].get("deletionTimestamp"):
            new = copy.deepcopy(ns_obj)
            new["metadata"]["deletionTimestamp"] = now_rfc3339()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            new.setdefault("status", {})["phase"] = "Terminating"
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._bucket(NAMESPACE_TYPE)[("", name)] = new
            self._record(NAMESPACE_TYPE, "MODIFIED", new, ns_obj)
            for rt, obj in self._all_objects():
                if rt.namespaced and obj["metadata"].get("namespace") == name:
                    if obj["metadata"].get("finalizers"):
                        self._mark_deleting(rt, obj)
                    else:
                        self._remove(rt, obj)
        self._maybe_finish_namespace(name)
        return self._deleted_status(NAMESPACE_TYPE, ns_obj)

    def _maybe_finish_namespace(self, name: str) -> None:
        ns_obj = self._bucket(NAMESPACE_TYPE).get(("", name))
        if not ns_obj or not ns_obj["metadata"].get("deletionTimestamp") or ns_obj["metadata"].get("finalizers"):
            return
        if any(rt.namespaced and o["metadata"].get("namespace") == name for rt, o in self._all_objects()):
            return
        self._remove(NAMESPACE_TYPE, ns_obj)

    # ----- admission -------------------------------------------------------------------------

    def _check_name(self, rt: ResourceType, name: str) -> None:
        pattern, limit = (_DNS1123_LABEL, 63) if rt.key == NAMESPACE_TYPE.key else (_DNS1123_SUBDOMAIN, 253)
        if len(name) > limit or not pattern.match(name):
            raise invalid(rt, name, [FieldError("metadata.name", "Invalid value", name,
                                                "a lowercase RFC 1123 subdomain must consist of lower case "
                                                "alphanumeric characters, '-' or '.', and must start and end with "
                                                "an alphanumeric character")])

    def _check_namespace_open(self, ns: str) -> None:
        ns_obj = self._bucket(NAMESPACE_TYPE).get(("", ns))
        if ns_obj is None:
            raise not_found(NAMESPACE_TYPE, ns)
        if ns_obj["metadata"].get("deletionTimestamp"):
            raise ApiError(403, "Forbidden", f"unable to create new content in namespace {ns} because it is being "
                           "terminated", {"name": ns, "kind": "namespaces"})

    def _admit(self, rt: ResourceType, obj: Obj, old: Obj | None, opts: WriteOptions) -> Obj:
        obj = kinds.before_write(rt, obj, old)
        if rt.crd and rt.schema is not None:
            obj, errs, unknown = admit(rt.schema, obj, old)
            if unknown and opts.field_validation == "Strict":
                listed = ", ".join(f'unknown field "{u}"' for u in unknown)
                raise bad_request(f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: '
                                  f"strict decoding error: {listed}")
            if unknown and opts.field_validation == "Warn":
                opts.warnings.extend(f'unknown field "{u}"' for u in unknown)
            if errs:
                raise invalid(rt, obj["metadata"].get("name", ""), errs)
        return obj
