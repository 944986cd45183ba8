"""What the server serves: built-in kinds and CRD-defined kinds, looked up by group/version/plural."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

# Field selectors the real API server accepts per kind (besides metadata.name / metadata.namespace);
# anything else is a 400 there, so it is here too.
_POD_FIELDS = ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
               "status.phase", "status.podIP", "status.nominatedNodeName")
_EVENT_FIELDS = ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
                 "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath",
                 "reason", "reportingComponent", "source", "type")


@dataclass
class ResourceType:
    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool
    singular: str = ""
    status: bool = False  # has a status subresource
    # On create with a status subresource, status is dropped (CRDs) or reset to this (pods, PVs, ...);
    # None keeps what the client sent (nodes: the kubelet registers with status).
    initial_status: dict[str, Any] | None = field(default_factory=dict)
    short_names: tuple[str, ...] = ()
    extra_fields: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None  # openAPIV3Schema, CRDs only
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    crd: bool = False
    # DELETE answers with the object (pods, PVs, PVCs, services, service accounts) or with a Status
    # (everything else), as the official client's response types expect.
    delete_returns_object: bool = False

    def __post_init__(self) -> None:
        self.singular = self.singular or self.kind.lower()

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def group_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def key(self) -> tuple[str, str]:
        """Storage identity: one object set per group+resource, whatever the version."""
        return (self.group, self.plural)

    @property
    def field_labels(self) -> frozenset[str]:
        return frozenset(("metadata.name", "metadata.namespace", *self.extra_fields))

    def discovery(self) -> list[dict[str, Any]]:
        verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        main: dict[str, Any] = {
            "name": self.plural, "singularName": self.singular, "namespaced": self.namespaced,
            "kind": self.kind, "verbs": verbs,
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        out = [main]
        if self.status:
            out.append({"name": f"{self.plural}/status", "singularName": "", "namespaced": self.namespaced,
                        "kind": self.kind, "verbs": ["get", "patch", "update"]})
        return out


def _b(group: str, version: str, kind: str, plural: str, namespaced: bool, **kw: Any) -> ResourceType:
    return ResourceType(group, version, kind, plural, namespaced, **kw)


BUILTINS: list[ResourceType] = [
    _b("", "v1", "Namespace", "namespaces", False, status=True, initial_status={"phase": "Active"},
       short_names=("ns",), extra_fields=("status.phase",)),
    _b("", "v1", "Node", "nodes", False, status=True, initial_status=None, short_names=("no",),
       extra_fields=("spec.unschedulable",)),
    _b("", "v1", "Pod", "pods", True, delete_returns_object=True, status=True, initial_status={"phase": "Pending"},
       short_names=("po",), extra_fields=_POD_FIELDS),
    _b("", "v1", "PersistentVolume", "persistentvolumes", False, delete_returns_object=True, status=True,
       initial_status={"phase": "Pending"}, short_names=("pv",)),
    _b("", "v1", "PersistentVolumeClaim", "persistentvolumeclaims", True, delete_returns_object=True, status=True,
       initial_status={"phase": "Pending"}, short_names=("pvc",)),
    _b("", "v1", "Secret", "secrets", True, extra_fields=("type",)),
    _b("", "v1", "ServiceAccount", "serviceaccounts", True, delete_returns_object=True, short_names=("sa",)),
    _b("", "v1", "ConfigMap", "configmaps", True, short_names=("cm",)),
    _b("", "v1", "Event", "events", True, short_names=("ev",), extra_fields=_EVENT_FIELDS),
    _b("", "v1", "Service", "services", True, delete_returns_object=True, status=True, short_names=("svc",)),
    _b("", "v1", "Endpoints", "endpoints", True, singular="endpoints", short_names=("ep",)),
    _b("coordination.k8s.io", "v1", "Lease", "leases", True),
    _b("events.k8s.io", "v1", "Event", "events", True, short_names=("ev",)),
    _b("apps", "v1", "Deployment", "deployments", True, status=True, short_names=("deploy",)),
    _b("apps", "v1", "DaemonSet", "daemonsets", True, status=True, short_names=("ds",)),
    _b("apps", "v1", "StatefulSet", "statefulsets", True, status=True, short_names=("sts",)),
    _b("apps", "v1", "ReplicaSet", "replicasets", True, status=True, short_names=("rs",)),
    _b("batch", "v1", "Job", "jobs", True, status=True, extra_fields=("status.successful",)),
    _b("rbac.authorization.k8s.io", "v1", "Role", "roles", True),
    _b("rbac.authorization.k8s.io", "v1", "RoleBinding", "rolebindings", True),
    _b("rbac.authorization.k8s.io", "v1", "ClusterRole", "clusterroles", False),
    _b("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding", "clusterrolebindings", False),
    _b("admissionregistration.k8s.io", "v1", "ValidatingWebhookConfiguration",
       "validatingwebhookconfigurations", False),
    _b("admissionregistration.k8s.io", "v1", "MutatingWebhookConfiguration", "mutatingwebhookconfigurations", False),
    _b("apiextensions.k8s.io", "v1", "CustomResourceDefinition", "customresourcedefinitions", False, status=True,
       short_names=("crd", "crds")),
    _b("policy", "v1", "PodDisruptionBudget", "poddisruptionbudgets", True, status=True, short_names=("pdb",)),
    _b("networking.k8s.io", "v1", "NetworkPolicy", "networkpolicies", True, short_names=("netpol",)),
    _b("storage.k8s.io", "v1", "StorageClass", "storageclasses", False, short_names=("sc",)),
    _b("scheduling.k8s.io", "v1", "PriorityClass", "priorityclasses", False, short_names=("pc",)),
]

CRD_TYPE = next(rt for rt in BUILTINS if rt.plural == "customresourcedefinitions")
NAMESPACE_TYPE = next(rt for rt in BUILTINS if rt.plural == "namespaces")


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Sort key: v2 before v1 before v1beta2 before v1beta1 before v1alpha1 before anything else."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not m:
        return (3, 0, 0, version)
    stage = {None: 0, "beta": 1, "alpha": 2}[m.group(2)]
    return (stage, -int(m.group(1)), -int(m.group(3) or 0), version)


def types_from_crd(crd: dict[str, Any]) -> list[ResourceType]:
    """One ResourceType per served version of a CustomResourceDefinition object."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    out = []
    for v in spec.get("versions") or []:
        if not v.get("served", True):
            continue
        out.append(ResourceType(
            group=spec["group"], version=v["name"], kind=names["kind"], plural=names["plural"],
            namespaced=spec.get("scope") == "Namespaced", singular=names.get("singular", ""),
            status="status" in (v.get("subresources") or {}), initial_status=None if "status" not in
            (v.get("subresources") or {}) else {},
            short_names=tuple(names.get("shortNames") or ()),
            schema=(v.get("schema") or {}).get("openAPIV3Schema") or {"type": "object",
                                                                       "x-kubernetes-preserve-unknown-fields": True},
            printer_columns=list(v.get("additionalPrinterColumns") or []), crd=True,
        ))
    return out


class Registry:
    """Thread-safe map (group, version, plural) -> ResourceType; CRDs come and go at runtime."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._by_crd: dict[str, list[ResourceType]] = {}
        for rt in BUILTINS:
            self._types[(rt.group, rt.version, rt.plural)] = rt

    def get(self, group: str, version: str, plural: str) -> ResourceType | None:
        with self._lock:
            return self._types.get((group, version, plural))

    def all(self) -> list[ResourceType]:
        with self._lock:
            return list(self._types.values())

    def groups(self) -> dict[str, list[str]]:
        """group -> versions, in Kubernetes priority order (GA > beta > alpha; the first is preferred)."""
        out: dict[str, list[str]] = {}
        for rt in self.all():
            versions = out.setdefault(rt.group, [])
            if rt.version not in versions:
                versions.append(rt.version)
        return {g: sorted(vs, key=version_priority) for g, vs in out.items()}

    def register_crd(self, crd: dict[str, Any]) -> None:
        name = crd["metadata"]["name"]
        with self._lock:
            for rt in self._by_crd.pop(name, []):
                self._types.pop((rt.group, rt.version, rt.plural), None)
            types = types_from_crd(crd)
            self._by_crd[name] = types
            for rt in types:
                self._types[(rt.group, rt.version, rt.plural)] = rt

    def unregister_crd(self, name: str) -> list[ResourceType]:
        with self._lock:
            types = self._by_crd.pop(name, [])
            for rt in types:
                self._types.pop((rt.group, rt.version, rt.plural), None)
            return types
