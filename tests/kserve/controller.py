"""KServe installed on a test control plane from its own manifests, and its controllers (the
controller manager; the local-model controller) run as processes with their own ServiceAccounts.

Everything is read from KServe's module in the Go module cache (`kserve_source()`), the release
that tests/kserve/go.mod pins and .work/kserve/bin/manager was built from:
- CRDs: config/crd/full (InferenceService, ServingRuntime, ClusterServingRuntime, TrainedModel,
  InferenceGraph; the LocalModel* ones only where a test applies them over ours);
- RBAC: config/rbac (ServiceAccount `kserve-controller-manager`, ClusterRole `kserve-manager-role`,
  the leader-election Role) and config/rbac/localmodel, in the `kserve` namespace as
  config/default puts them;
- config/configmap/inferenceservice.yaml, with the deployment mode (Standard, KServe's raw
  deployment mode: Deployments, no Knative) and `localModel.enabled` set as a user would, and no
  Istio;
- config/webhook/manifests.yaml and config/webhook/localmodel, reached by url
  (tests/cluster/webhooks.py);
- config/runtimes, through kustomize as KServe's install does (images set, pods never run).
"""

from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trustme
import yaml

from tests.cluster.controlplane import Proc
from tests.cluster.webhooks import by_url
from tests.helpers import free_port, require, wait_until
from tests.kserve.build import KSERVE, kserve_source

NAMESPACE = "kserve"
#: Where KServe's local-model controller puts its download PVCs (`localModel.jobNamespace`).
JOB_NAMESPACE = "kserve-localmodel-jobs"
FIELD_MANAGER = "kserve-install"
SERVING_CRDS = tuple(f"config/crd/full/serving.kserve.io_{plural}.yaml" for plural in (
    "inferenceservices", "servingruntimes", "clusterservingruntimes", "trainedmodels", "inferencegraphs"))
LOCALMODEL_CRDS = "config/crd/full/localmodel"


@dataclass(frozen=True)
class Component:
    """One of KServe's controllers: its binary, ServiceAccount, RBAC files and webhook configurations."""

    binary: str
    service_account: str
    rbac: tuple[str, ...]
    webhooks: str
    namespaces: tuple[str, ...] = field(default=())  # besides `kserve`, what it writes into


MANAGER = Component("manager", "kserve-controller-manager", tuple(f"config/rbac/{name}" for name in (
    "service_account.yaml", "role.yaml", "role_binding.yaml", "leader_election_role.yaml",
    "leader_election_role_binding.yaml")), "config/webhook/manifests.yaml")
LOCAL_MODEL = Component("localmodel", "kserve-localmodel-controller-manager", ("config/rbac/localmodel",),
                        "config/webhook/localmodel/manifests.yaml", (JOB_NAMESPACE,))


def require_binary(component: Component = MANAGER) -> Path:
    require(KSERVE.up_to_date(), f"KServe's controllers in {KSERVE.bin_dir} (tests/setup.d/55-kserve.sh)")
    return KSERVE.bin_dir / component.binary


def docs_of(*relative: str) -> list[dict[str, Any]]:
    """The YAML documents of KServe's files (or every *.yaml of a folder), in order."""
    out: list[dict[str, Any]] = []
    for rel in relative:
        path = kserve_source() / rel
        files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
        for f in files:
            if f.name == "kustomization.yaml":
                continue
            out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def apply(cluster: Any, docs: list[dict[str, Any]], *flags: str) -> None:
    """Server-side apply as KServe's install instructions do (`kubectl apply --server-side`); the
    conflicts with fields another manager (deploy/, for shared CRDs) set are forced, as an upgrade's."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager", FIELD_MANAGER, *flags, "-f", "-",
                    input=yaml.safe_dump_all(docs))


def wait_established(cluster: Any, docs: list[dict[str, Any]]) -> None:
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"]
    if names:
        cluster.kubectl("wait", "--for", "condition=Established", "--timeout", "60s",
                        *(f"crd/{n}" for n in names))


def config_map(mode: str = "Standard", local_model: bool = True, storage_initializer: str | None = None
               ) -> dict[str, Any]:
    """KServe's inferenceservice-config with the deployment mode and `localModel.enabled` set, and
    Istio's VirtualService off as KServe's own event advises on a cluster without Istio;
    ``storage_initializer``: the image of the init container KServe puts in predictor pods (ours,
    to drop it in)."""
    (cm,) = docs_of("config/configmap/inferenceservice.yaml")
    if storage_initializer is not None:
        cm["data"]["storageInitializer"] = json.dumps({**json.loads(cm["data"]["storageInitializer"]),
                                                       "image": storage_initializer})
    cm["metadata"]["namespace"] = NAMESPACE
    cm["data"]["ingress"] = json.dumps({**json.loads(cm["data"]["ingress"]), "disableIstioVirtualHost": True})
    cm["data"]["deploy"] = json.dumps({**json.loads(cm["data"]["deploy"]), "defaultDeploymentMode": mode})
    cm["data"]["localModel"] = json.dumps({**json.loads(cm["data"]["localModel"]), "enabled": local_model})
    return cm


def rbac(component: Component) -> list[dict[str, Any]]:
    """A component's ServiceAccount, roles and bindings, in KServe's namespace as config/default puts them."""
    docs = docs_of(*component.rbac)
    for doc in docs:
        if doc["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            doc["metadata"]["namespace"] = NAMESPACE
        for subject in doc.get("subjects") or ():
            if subject["kind"] == "ServiceAccount":
                subject["namespace"] = NAMESPACE
    return docs


def runtime(cluster: Any, name: str = "kserve-sklearnserver") -> dict[str, Any]:
    """One of KServe's ClusterServingRuntimes, built by kustomize from config/runtimes as installed."""
    out = cluster.kubectl("kustomize", str(kserve_source() / "config" / "runtimes")).stdout
    (doc,) = [d for d in yaml.safe_load_all(out) if d and d["metadata"]["name"] == name]
    return dict(doc)


def install(cluster: Any, local_model: bool = True, components: tuple[Component, ...] = (MANAGER,),
            storage_initializer: str | None = None) -> None:
    """KServe's CRDs, namespaces, the components' RBAC, the config map and the sklearn runtime."""
    crds = docs_of(*SERVING_CRDS)
    apply(cluster, crds)
    wait_established(cluster, crds)
    namespaces = [NAMESPACE, *(ns for c in components for ns in c.namespaces)]
    apply(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}} for ns in namespaces])
    apply(cluster, [*(doc for c in components for doc in rbac(c)),
                    config_map(local_model=local_model, storage_initializer=storage_initializer)])
    apply(cluster, [runtime(cluster)])


@dataclass
class KServeProcess:
    proc: Proc
    webhook_port: int
    health_port: int
    ca_pem: bytes

    def log(self) -> str:
        return self.proc.log_path.read_text(errors="replace") if self.proc.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self) -> None:
        self.proc.stop()

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False


def start(cluster: Any, workdir: Path, component: Component = MANAGER) -> KServeProcess:
    """One of KServe's controllers as its ServiceAccount (KServe's own RBAC), its webhook server on a
    free port with a certificate of a fresh CA, and its webhook configurations registered by url."""
    binary = require_binary(component)
    workdir.mkdir(parents=True, exist_ok=True)
    # controller-runtime reads its serving certificate from $TMPDIR/k8s-webhook-server/serving-certs.
    tmp = workdir / "tmp"
    certs = tmp / "k8s-webhook-server" / "serving-certs"
    certs.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="kserve webhook test CA")
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    leaf.cert_chain_pems[0].write_to_path(str(certs / "tls.crt"))
    leaf.private_key_pem.write_to_path(str(certs / "tls.key"))
    kubeconfig = cluster.kubeconfig_for(NAMESPACE, component.service_account)
    webhook_port, health_port = free_port(), free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KUBECONFIG")},
           "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": NAMESPACE, "TMPDIR": str(tmp)}
    name = f"kserve-{component.binary}"
    proc = Proc(name, [str(binary), "--metrics-addr", "0", "--webhook-port", str(webhook_port),
                       "--health-probe-addr", f"127.0.0.1:{health_port}"], workdir / f"{name}.log", env=env).start()
    mgr = KServeProcess(proc, webhook_port, health_port, ca.cert_pem.bytes())
    try:
        wait_until(lambda: mgr.ready() or not mgr.alive(), timeout=60, what=f"KServe's {component.binary}")
        if not mgr.alive():
            raise RuntimeError(f"KServe's {component.binary} exited:\n{proc.log_tail(40)}")
        hooks = by_url(docs_of(component.webhooks), f"https://127.0.0.1:{webhook_port}", mgr.ca_pem)
        apply(cluster, hooks)
    except BaseException:
        mgr.stop()
        raise
    return mgr
