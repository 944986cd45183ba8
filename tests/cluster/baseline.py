"""What every test starts from on a shared control plane, and how to get back to it.

The baseline is what an operator installs before modelcache runs: our CRDs, our namespace and
RBAC (deploy/), and KServe's InferenceService / LLMInferenceService CRDs (minimal schemas, in
tests/cluster/crds/). `snapshot()` records every object then; `reset()` deletes everything a test
added (finalizers released, pods force-deleted since no kubelet confirms their deletion, webhook
configurations first so a stopped coordinator's fail-closed webhook cannot block the rest) and
puts changed or missing baseline objects back.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster.controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BASELINE_MANIFESTS = (DEPLOY / "namespace.yaml", DEPLOY / "crds", DEPLOY / "rbac", DEPLOY / "policies",
                      REPO / "tests" / "cluster" / "crds")
#: Namespaces a fresh cluster has, plus ours.
SYSTEM_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease", "modelcache-system",
                               "modelcache-credentials"})
#: Kinds whose baseline objects are put back by re-applying the manifests when they change.
RESTORED_KINDS = frozenset({"customresourcedefinitions", "clusterroles", "clusterrolebindings", "roles",
                            "rolebindings", "serviceaccounts", "namespaces", "validatingadmissionpolicies",
                            "validatingadmissionpolicybindings"})
#: Objects controllers create by themselves in every namespace; they go with their namespace.
_AUTOMATIC = {("configmaps", "kube-root-ca.crt"), ("serviceaccounts", "default")}
_NOT_RESET = frozenset({"apiservices", "flowschemas", "prioritylevelconfigurations", "clustertrustbundles",
                        "componentstatuses", "bindings", "servicecidrs", "ipaddresses"})


@dataclass(frozen=True)
class Kind:
    plural: str
    path: str  # /api/v1 or /apis/<group>/<version>
    namespaced: bool


@dataclass
class Baseline:
    kinds: list[Kind]
    objects: dict[str, tuple[str, str]] = field(default_factory=dict)  # uid -> (plural, resourceVersion)


def apply_manifests(cp: ControlPlane, paths: tuple[Path, ...] = BASELINE_MANIFESTS, exact: bool = False) -> None:
    """Apply the manifests; ``exact`` then replaces each object by its manifest, which also drops
    what other field managers added (a label a test set, say), as server-side apply does not."""
    files: list[str] = []
    for p in paths:
        files += ["-f", str(p)]
    cp.kubectl("apply", "--server-side", "--force-conflicts", *files)
    if exact:
        cp.kubectl("replace", *files)
    cp.kubectl("wait", "--for", "condition=Established", "--timeout", "60s", "crd", "--all")


def _get(cp: ControlPlane, path: str) -> dict[str, Any]:
    status, body = cp.raw(path, timeout=30)
    if status != 200:
        raise RuntimeError(f"GET {path} answered {status}: {body[:300]}")
    return dict(json.loads(body))


def discover(cp: ControlPlane) -> list[Kind]:
    """Every kind that can be listed and deleted, once each (a group's kinds may live in different
    versions: serving.kserve.io has v1alpha1 caches and v1beta1 InferenceServices)."""
    paths = ["/api/v1"]
    for group in _get(cp, "/apis")["groups"]:
        preferred = group["preferredVersion"]["groupVersion"]
        others = [v["groupVersion"] for v in group["versions"] if v["groupVersion"] != preferred]
        paths += [f"/apis/{gv}" for gv in (preferred, *others)]
    kinds: list[Kind] = []
    seen: set[tuple[str, str]] = set()
    for path in paths:
        group = path.split("/")[2] if path.startswith("/apis/") else ""
        for r in _get(cp, path)["resources"]:
            verbs = set(r.get("verbs") or ())
            if "/" in r["name"] or not {"list", "delete"} <= verbs or r["name"] in _NOT_RESET:
                continue
            if (group, r["name"]) not in seen:
                seen.add((group, r["name"]))
                kinds.append(Kind(r["name"], path, bool(r["namespaced"])))
    return kinds


def _items(cp: ControlPlane, kind: Kind) -> list[dict[str, Any]]:
    status, body = cp.raw(f"{kind.path}/{kind.plural}", timeout=30)
    if status == 404:  # a CRD that a test removed
        return []
    if status != 200:
        raise RuntimeError(f"listing {kind.plural} answered {status}: {body[:300]}")
    return list(json.loads(body).get("items") or [])


def snapshot(cp: ControlPlane) -> Baseline:
    base = Baseline(discover(cp))
    for kind in base.kinds:
        for item in _items(cp, kind):
            meta = item["metadata"]
            base.objects[meta["uid"]] = (kind.plural, meta.get("resourceVersion", ""))
    return base


def _object_path(kind: Kind, meta: dict[str, Any]) -> str:
    ns = f"/namespaces/{meta['namespace']}" if kind.namespaced else ""
    return f"{kind.path}{ns}/{kind.plural}/{urllib.parse.quote(meta['name'])}"


def _delete(cp: ControlPlane, kind: Kind, meta: dict[str, Any]) -> None:
    path = _object_path(kind, meta)
    if meta.get("finalizers"):
        status, body = cp.raw(path, "PATCH", {"metadata": {"finalizers": None}})
        if status not in (200, 404):
            raise RuntimeError(f"releasing the finalizers of {path} answered {status}: {body[:300]}")
    status, body = cp.raw(path, "DELETE", {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                                           "propagationPolicy": "Background"})
    if status not in (200, 202, 404):
        raise RuntimeError(f"deleting {path} answered {status}: {body[:300]}")


def _still_there(cp: ControlPlane, kind: Kind, meta: dict[str, Any]) -> bool:
    """True while the object exists with the same uid (a controller may re-create one by name)."""
    status, body = cp.raw(_object_path(kind, meta), timeout=10)
    return status == 200 and json.loads(body)["metadata"]["uid"] == meta["uid"]


def _crd(cp: ControlPlane, name: str) -> dict[str, Any] | None:
    status, body = cp.raw(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}", timeout=10)
    return json.loads(body) if status == 200 else None


def _release_instances(cp: ControlPlane, crd_name: str) -> None:
    """Release the finalizers of the instances of a CRD being deleted, and delete them."""
    crd = _crd(cp, crd_name)
    if crd is None:
        return
    spec = crd["spec"]
    version = next((v["name"] for v in spec["versions"] if v.get("storage")), spec["versions"][0]["name"])
    kind = Kind(spec["names"]["plural"], f"/apis/{spec['group']}/{version}", spec["scope"] == "Namespaced")
    for item in _items(cp, kind):
        _delete(cp, kind, item["metadata"])


def _terminating(cp: ControlPlane, kind: Kind, meta: dict[str, Any]) -> str:
    """What the API server says keeps a CRD (its Terminating condition), for the error."""
    if kind.plural != "customresourcedefinitions":
        return ""
    crd = _crd(cp, meta["name"]) or {}
    for cond in crd.get("status", {}).get("conditions", []):
        if cond.get("type") == "Terminating":
            return f" ({cond.get('reason')}: {cond.get('message')})"
    return ""


def reset(cp: ControlPlane, base: Baseline, timeout: float = 180) -> None:
    """Delete what tests added; re-apply the baseline manifests if any of their objects changed."""
    order = sorted(base.kinds, key=lambda k: (k.plural not in ("mutatingwebhookconfigurations",
                                                                "validatingwebhookconfigurations"),
                                              k.plural in ("namespaces", "customresourcedefinitions")))
    leftovers: list[tuple[Kind, dict[str, Any]]] = []
    changed = False
    seen: set[str] = set()
    for kind in order:
        for item in _items(cp, kind):
            meta = item["metadata"]
            seen.add(meta["uid"])
            known = base.objects.get(meta["uid"])
            if known is not None:
                if kind.plural in RESTORED_KINDS and known[1] != meta.get("resourceVersion"):
                    changed = True
                continue
            if (kind.plural, meta["name"]) in _AUTOMATIC or meta.get("namespace") == "kube-node-lease":
                continue
            if kind.plural == "namespaces" and meta["name"] in SYSTEM_NAMESPACES:
                continue
            _delete(cp, kind, meta)
            leftovers.append((kind, meta))
    missing = any(uid not in seen and plural in RESTORED_KINDS for uid, (plural, _) in base.objects.items())
    deadline = time.monotonic() + timeout
    for kind, meta in leftovers:
        nudge = time.monotonic() + 5
        while _still_there(cp, kind, meta):
            if kind.plural == "customresourcedefinitions" and time.monotonic() > nudge:
                # The API server deletes a CRD only after every instance is gone; an instance whose
                # controller (a test's KServe) has stopped keeps its finalizer for ever.
                _release_instances(cp, meta["name"])
                if "InstanceDeletionFailed" in _terminating(cp, kind, meta):
                    # Seen on v1.37: "could not list instances: storage is (re)initializing" for
                    # minutes for a CRD deleted right after it was created. Its instances are gone
                    # (released above) or were never made: let the CRD go.
                    cp.raw(_object_path(kind, meta), "PATCH", {"metadata": {"finalizers": None}})
                nudge = time.monotonic() + 5
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kind.plural} {meta.get('namespace', '')}/{meta['name']} was not deleted "
                                   f"within {timeout:.0f} s of the reset{_terminating(cp, kind, meta)}")
            time.sleep(0.1)
    if changed or missing:
        apply_manifests(cp, exact=True)
        fresh = snapshot(cp)
        base.objects = fresh.objects
