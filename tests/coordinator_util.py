"""Helpers for coordinator tests: objects as a user (or kubelet, or agent) would write them."""

from __future__ import annotations

from typing import Any

from modelcache.kube.client import (
    INFERENCE_SERVICES,
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    LOCAL_MODEL_NODES,
    NAMESPACES,
    NODES,
    SERVICE_ACCOUNTS,
    Kube,
)
from tests.cluster.webhooks import register_webhooks as cluster_webhooks
from tests.helpers import wait_until

GROUP_LABEL = "kserve/localmodel"


def ready_condition(ready: bool) -> dict[str, Any]:
    return {"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady"}


def make_node(kube: Kube, name: str, ready: bool = True, **labels: str) -> dict[str, Any]:
    """A Node as its kubelet registers it. The TaintNodesByCondition admission plugin taints it
    not-ready; the node lifecycle controller (off in the test cluster: no kubelets) would lift it."""
    resources = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    body = {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
            "status": {"conditions": [ready_condition(ready)], "capacity": resources, "allocatable": resources}}
    kube.create(NODES, body)
    return kube.patch(NODES, name, {"spec": {"taints": None}})


def set_ready(kube: Kube, name: str, ready: bool) -> None:
    kube.patch_status(NODES, name, {"status": {"conditions": [ready_condition(ready)]}})


def make_group(kube: Kube, name: str, label_value: str = "worker", path: str = "/models") -> dict[str, Any]:
    return kube.create(LOCAL_MODEL_NODE_GROUPS, {"metadata": {"name": name}, "spec": {
        "storageLimit": "10Gi",
        "persistentVolumeSpec": {
            "accessModes": ["ReadWriteOnce"], "volumeMode": "Filesystem", "capacity": {"storage": "10Gi"},
            "local": {"path": path}, "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "local-storage",
            "nodeAffinity": {"required": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": GROUP_LABEL, "operator": "In", "values": [label_value]}]}]}},
        },
        "persistentVolumeClaimSpec": {
            "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}},
            "storageClassName": "local-storage", "volumeMode": "Filesystem",
        },
    }})


def group_manifest(kube: Kube, name: str) -> dict[str, Any]:
    """A node group as its manifest in git would have it (for a re-apply or `kubectl replace`)."""
    obj = kube.get(LOCAL_MODEL_NODE_GROUPS, name)
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": {"name": name}, "spec": obj["spec"]}


def make_cache(kube: Kube, name: str, uri: str, groups: list[str], namespace: str | None = None,
               **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": name}, "spec": {"sourceModelUri": uri, "modelSize": "1Mi",
                                                                  "nodeGroups": groups, **spec}}
    if namespace:
        body["metadata"]["namespace"] = namespace
        return kube.create(LOCAL_MODEL_NAMESPACE_CACHES, body, namespace)
    return kube.create(LOCAL_MODEL_CACHES, body)


def make_namespace(kube: Kube, name: str) -> None:
    """The namespace, once pods can be created in it: the controller-manager makes its ``default``
    ServiceAccount a moment after it, and until then the API server's ServiceAccount admission
    refuses a pod (seen in CI: 'serviceaccount "default" not found')."""
    if kube.get_or_none(NAMESPACES, name) is None:
        kube.create(NAMESPACES, {"metadata": {"name": name}})
    wait_until(lambda: kube.get_or_none(SERVICE_ACCOUNTS, "default", name) is not None, timeout=60,
               what=f"namespace {name}'s default ServiceAccount")


def make_isvc(kube: Kube, name: str, namespace: str, uri: str, annotations: dict[str, str] | None = None,
              labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if annotations:
        meta["annotations"] = annotations
    if labels:
        meta["labels"] = labels
    body = {"metadata": meta, "spec": {"predictor": {"model": {"modelFormat": {"name": "sklearn"}, "storageUri": uri}}}}
    return kube.create(INFERENCE_SERVICES, body, namespace)


def report(kube: Kube, node: str, states: dict[str, str]) -> None:
    """Act as the node's agent: set status.modelStatus. An agent reports only once its
    LocalModelNode exists; the coordinator holds node writes while caches keep arriving (up to
    30 s, coordinator/pacing.py CacheBurst), and other tests' caches on the shared API server count."""
    wait_until(lambda: kube.get_or_none(LOCAL_MODEL_NODES, node) is not None, timeout=60,
               what=f"LocalModelNode {node}")
    lmn = kube.get(LOCAL_MODEL_NODES, node)
    current = (lmn.get("status") or {}).get("modelStatus") or {}
    patch = {k: None for k in current if k not in states}
    patch.update(states)
    kube.patch_status(LOCAL_MODEL_NODES, node, {"status": {"modelStatus": patch}})


def entries_of(kube: Kube, node: str) -> list[dict[str, Any]] | None:
    lmn = kube.get_or_none(LOCAL_MODEL_NODES, node)
    return None if lmn is None else list((lmn.get("spec") or {}).get("localModels") or [])


def without_service_crds(cluster: Any) -> None:
    """Remove KServe's InferenceService CRD (the shared cluster's reset puts it back)."""
    cluster.kubectl("delete", "crd", "inferenceservices.serving.kserve.io", "--ignore-not-found", "--wait=true")


def register_webhooks(cluster: Any, coordinator: Any) -> None:
    """deploy/webhooks/*.yaml as shipped, but called by the API server at the coordinator's port."""
    cluster_webhooks(cluster.cp, coordinator.cfg.webhook_port, coordinator.cfg.webhook_cert_dir / "tls.crt")


def agent_report(kube: Kube, node: str, states: dict[str, tuple[str, str]], node_uid: str | None = None) -> None:
    """Act as our agent: ``modelStatus`` with the details naming each entry's storageKey and URI,
    and the uid of the Node it read (``states``: status key -> (state, sourceModelUri))."""
    from modelcache.sources.uri import storage_key

    status: dict[str, Any] = {
        "modelStatus": {k: s for k, (s, _uri) in states.items()},
        "modelDetails": {k: {"state": s, "storageKey": storage_key(uri), "sourceModelUri": uri}
                         for k, (s, uri) in states.items()},
    }
    if node_uid:
        status["nodeUID"] = node_uid
    kube.patch_status(LOCAL_MODEL_NODES, node, {"status": status})


class ReconcileProbe:
    """Wraps one controller of an in-process coordinator: every reconcile it finishes, with what
    ``snapshot(key)`` said when it began (so a test knows a reconcile saw a given state)."""

    def __init__(self, coordinator: Any, controller: str, snapshot: Any = lambda _key: None) -> None:
        import threading

        ctl = next(c for c in coordinator.manager.controllers if c.name == controller)
        self.controller = ctl
        self.done: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        inner = ctl.reconcile

        def run(key: str) -> Any:
            seen = snapshot(key)
            try:
                return inner(key)
            finally:
                with self._lock:
                    self.done.append((key, seen))

        ctl.reconcile = run

    def finished(self, key: str, when: Any = lambda _seen: True) -> bool:
        with self._lock:
            return any(k == key and when(seen) for k, seen in self.done)

    def count(self) -> int:
        with self._lock:
            return len(self.done)
