"""Running the image's containers as deploy/'s manifests define them, the way the kubelet would:
the pod spec read from the manifest, env with fieldRefs resolved, $(VAR) expanded in args, the
securityContext's user, and the ServiceAccount volume plus KUBERNETES_SERVICE_* of in-cluster
configuration, pointed at the test control plane (tests/cluster)."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

from tests.fixtures.cluster import Cluster
from tests.fixtures.image import secret_volume
from tests.helpers import REPO

#: Where the kubelet mounts a pod's ServiceAccount token, CA and namespace.
SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def manifest_pod(relpath: str, kind: str) -> dict[str, Any]:
    """The pod template spec of the one ``kind`` object in ``deploy/<relpath>``."""
    docs = yaml.safe_load_all((REPO / "deploy" / relpath).read_text())
    obj = next(d for d in docs if d and d["kind"] == kind)
    return dict(obj["spec"]["template"]["spec"])


def resolve_env(container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """The container's env as the kubelet gives it: values, and fieldRefs from ``fields``."""
    out = {}
    for e in container.get("env", []):
        out[e["name"]] = e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def user_of(ctx: dict[str, Any], pod_ctx: dict[str, Any]) -> str:
    """The container's runAsUser:runAsGroup, the pod's where the container sets none."""
    return f"{ctx.get('runAsUser', pod_ctx['runAsUser'])}:{ctx.get('runAsGroup', pod_ctx['runAsGroup'])}"


def service_account_volume(path: Path, cluster: Cluster, namespace: str, name: str, node: str | None = None) -> Path:
    """What the kubelet projects for a pod's ServiceAccount: a bound token, the CA, the namespace.
    With ``node``: the token bound to a pod on that Node, as every pod's is once scheduled (the
    agent's status writes are admitted only with it, deploy/policies/node-status.yaml)."""
    pod = cluster.cp.stand_in_pod(namespace, name, node) if node is not None else None
    return secret_volume(path, {"token": cluster.cp.token(namespace, name, pod=pod).encode(),
                                "ca.crt": cluster.ca_file.read_bytes(), "namespace": namespace.encode()})


def in_cluster_env(cluster: Cluster) -> dict[str, str]:
    """The kubelet's variables for every pod: where the API server is (the control plane's port)."""
    return {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(urllib.parse.urlsplit(cluster.server).port)}
