"""deploy/ runs as pods on real nodes (issue 24, item 2): `kubectl apply -k` an overlay that only sets
the image reference, and the kubelets run what the manifests say.

- The agent DaemonSet's pods are Ready on both labelled nodes: its prepare-root init container
  handed the node's /models (hostPath, DirectoryOrCreate) to uid 1000, the agent reached the API
  server through the `kubernetes` Service (in-cluster config, kube-proxy), its projected peer
  token passed the TokenReview it makes at start, and it published its peer endpoint (the pod IP).
- Two coordinator replicas: one holds the Lease; deleting its pod hands the Lease to the other.
- The webhooks are called by the API server through the Service modelcache-coordinator-webhook:
  the API server resolves the Service to its endpoints (`--enable-aggregator-routing`: what a
  cluster without a route to ClusterIPs from the control plane uses) and dials the pod IP, which
  this machine routes to the nodes' network namespace; the CA in the configurations is the one
  the coordinator made and patched in.
- Probes pass (Ready, no restarts), root file systems are read-only, Pod Security holds.
- An agent's own token (the kubelet's) cannot write another node's LocalModelNode status.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelcache.kube.client import (
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    LOCAL_MODEL_NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
)
from modelcache.kube.types import CACHE_FINALIZER, NAMESPACE_CACHE_FINALIZER
from tests.cluster import cgroups
from tests.cluster.baseline import REPO
from tests.cluster.build import BIN
from tests.coordinator_util import make_isvc, make_namespace
from tests.fixtures.image import Image
from tests.fixtures.realnodes import NodeCluster, start_real_nodes
from tests.helpers import unique, wait_until
from tests.realnodes_util import (
    install,
    model_cache,
    node_group,
    origin_for_pods,
    s3_credentials,
    wait_downloaded,
)

pytestmark = [pytest.mark.xdist_group("realnodes"), pytest.mark.timeout(900)]
NS = "modelcache-system"
AGENT = "app.kubernetes.io/name=modelcache-agent"
COORDINATOR = "app.kubernetes.io/name=modelcache-coordinator"


def pods(cluster: NodeCluster, selector: str, namespace: str = NS) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    return list(json.loads(out)["items"])


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def lease_holder(cluster: NodeCluster) -> str:
    out = cluster.kubectl("get", "lease", "modelcache-coordinator", "-n", NS, "-o", "json", check=False)
    return str(json.loads(out.stdout)["spec"].get("holderIdentity") or "") if out.returncode == 0 else ""


#: Run in an agent container: PATCH another LocalModelNode's status with the pod's own token (the
#: kubelet's projected ServiceAccount token, which names the pod's Node); prints the HTTP code and
#: the API server's message.
PATCH_OTHER = """
import json, os, ssl, sys, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
host = os.environ["KUBERNETES_SERVICE_HOST"]
host = f"[{host}]" if ":" in host else host
url = f"https://{host}:{os.environ['KUBERNETES_SERVICE_PORT']}/apis/serving.kserve.io/v1alpha1/localmodelnodes/"
body = {"status": {"peer": {"endpoint": "10.6.6.6:8443", "certSHA256": "0" * 64}}}
req = urllib.request.Request(url + sys.argv[1] + "/status", data=json.dumps(body).encode(), method="PATCH",
                             headers={"Authorization": "Bearer " + open(sa + "/token").read().strip(),
                                      "Content-Type": "application/merge-patch+json"})
try:
    urllib.request.urlopen(req, timeout=20, context=ssl.create_default_context(cafile=sa + "/ca.crt"))
    print(json.dumps([200, ""]))
except urllib.error.HTTPError as exc:
    print(json.dumps([exc.code, json.loads(exc.read() or b"{}").get("message", "")]))
"""


def patch_status_from(cluster: NodeCluster, pod: dict[str, Any], node: str) -> tuple[int, str]:
    out = cluster.kubectl("exec", "-n", NS, pod["metadata"]["name"], "-c", "agent", "--", "python", "-c",
                          PATCH_OTHER, node).stdout
    code, message = json.loads(out.strip().splitlines()[-1])
    return int(code), str(message)


def test_deploy_runs_as_pods(real_nodes: NodeCluster, image: Image, tmp_path: Path) -> None:
    install(real_nodes, image.ref, tmp_path / "overlay")
    agents = pods(real_nodes, AGENT)
    assert sorted(p["spec"]["nodeName"] for p in agents) == ["node-1", "node-2"]
    assert all(ready(p) for p in agents)
    for pod in agents:
        node = real_nodes.node(pod["spec"]["nodeName"])
        root = node.host_path("/models")
        # prepare-root: the hostPath and its models/ are the agent's (uid 1000), not recursively.
        assert (root.stat().st_uid, root.stat().st_gid) == (1000, 1000)
        assert (root / "models").stat().st_uid == 1000
        log = real_nodes.kubectl("logs", "-n", NS, pod["metadata"]["name"], "-c", "agent").stdout
        assert "peer transfer on" in log, log[-3000:]  # the projected token passed its TokenReview

    coordinators = pods(real_nodes, COORDINATOR)
    assert len(coordinators) == 2 and all(ready(p) for p in coordinators)
    names = {p["metadata"]["name"] for p in coordinators}
    wait_until(lambda: lease_holder(real_nodes) in names, timeout=60, what="a coordinator pod holds the Lease")
    leader = lease_holder(real_nodes)

    # A write checked by the validating webhook through the Service: the second cache of one URI is
    # refused by our webhook (the API server called the coordinator pod).
    hooks = json.loads(real_nodes.kubectl("get", "validatingwebhookconfiguration", "-o", "json").stdout)["items"]
    ours = [h for cfg in hooks for h in cfg["webhooks"] if h["name"].endswith("modelcache.serving.kserve.io")]
    assert ours and all(h["clientConfig"]["service"]["name"] == "modelcache-coordinator-webhook" and
                        h["clientConfig"].get("caBundle") for h in ours)
    group = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNodeGroup",
             "metadata": {"name": "workers"}, "spec": {"storageLimit": "1Gi", "persistentVolumeSpec": {
                 "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"}, "local": {"path": "/models"},
                 "storageClassName": "local-storage", "nodeAffinity": {"required": {"nodeSelectorTerms": [
                     {"matchExpressions": [{"key": "kserve/localmodel", "operator": "In",
                                            "values": ["worker"]}]}]}}},
                 "persistentVolumeClaimSpec": {"accessModes": ["ReadWriteOnce"],
                                               "resources": {"requests": {"storage": "1Gi"}}}}}

    def cache(name: str) -> dict[str, Any]:
        return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache", "metadata": {"name": name},
                "spec": {"sourceModelUri": "s3://models/none", "modelSize": "1Mi", "nodeGroups": ["workers"]}}

    real_nodes.kubectl("apply", "-f", "-", input=yaml.safe_dump(group))
    real_nodes.kubectl("create", "-f", "-", input=yaml.safe_dump(cache("first")))
    dup = real_nodes.kubectl("create", "-f", "-", input=yaml.safe_dump(cache("second")), check=False)
    assert dup.returncode != 0 and "LocalModelCache first has the same StorageURI" in dup.stderr, dup.stderr

    # The coordinator gave each node of the group its LocalModelNode; each agent pod publishes its
    # peer endpoint there: its pod IP (downward API) and port.
    for pod in agents:
        def endpoint(node: str = pod["spec"]["nodeName"]) -> str:
            out = real_nodes.kubectl("get", "localmodelnode", node, "-o", "json", check=False)
            status = json.loads(out.stdout).get("status") or {} if out.returncode == 0 else {}
            return str((status.get("peer") or {}).get("endpoint", ""))

        expected = f"{pod['status']['podIP']}:8443"
        wait_until(lambda expected=expected: endpoint() == expected, timeout=90,  # type: ignore[misc]
                   what=f"the peer endpoint of {pod['metadata']['name']}")

    # Each node speaks only for itself (deploy/policies/node-status.yaml), with the token the kubelet
    # gave the agent's pod: node-1's agent may not write node-2's status (its peer endpoint and pinned
    # certificate, which the other agents trust as node-2's word).
    by_node = {p["spec"]["nodeName"]: p for p in agents}
    code, message = patch_status_from(real_nodes, by_node["node-1"], "node-2")
    assert code == 403, (code, message)
    assert ("LocalModelNode node-2: its status is written only from a pod on Node node-2; "
            f"system:serviceaccount:{NS}:modelcache-agent runs on Node node-1") in message, message
    node2 = json.loads(real_nodes.kubectl("get", "localmodelnode", "node-2", "-o", "json").stdout)
    assert node2["status"]["peer"]["endpoint"] == f"{by_node['node-2']['status']['podIP']}:8443"

    # Probes: still Ready a while later, no container restarted (liveness passes too).
    time.sleep(25)
    for pod in pods(real_nodes, AGENT) + pods(real_nodes, COORDINATOR):
        assert ready(pod), pod["metadata"]["name"]
        assert all(c["restartCount"] == 0 for c in pod["status"]["containerStatuses"]), pod["status"]

    # Read-only root file systems: only the emptyDir /tmp and the model root are writable.
    agent = agents[0]["metadata"]["name"]
    denied = real_nodes.kubectl("exec", "-n", NS, agent, "-c", "agent", "--", "python", "-c",
                                "open('/written-by-test', 'w')", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied
    assert real_nodes.kubectl("exec", "-n", NS, agent, "-c", "agent", "--", "python", "-c",
                              "open('/tmp/x', 'w').write('ok'); import os; print(os.getuid())").stdout.strip() == "1000"

    # Pod Security: the credentials namespace is `restricted`; an agent-like pod is refused there.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "root-host", "namespace": "modelcache-credentials"},
           "spec": {"containers": [{"name": "c", "image": image.ref, "volumeMounts": [{"name": "h",
                                                                                       "mountPath": "/h"}]}],
                    "volumes": [{"name": "h", "hostPath": {"path": "/models"}}]}}
    refused = real_nodes.kubectl("create", "-f", "-", input=yaml.safe_dump(pod), check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr

    # Leader election between real pods: the leader's pod goes, the other replica takes the Lease.
    real_nodes.kubectl("delete", "pod", "-n", NS, leader, "--wait=false")
    wait_until(lambda: lease_holder(real_nodes) not in ("", leader), timeout=120,
               what="the other coordinator takes the Lease")
    assert lease_holder(real_nodes) in names


def test_delete_k_with_caches_present_completes_as_the_kubelets_stop_our_pods(image: Image, tmp_path: Path) -> None:
    """`kubectl delete -k` of the overlay, with caches the coordinator holds (finalizers, entries on
    both nodes, serving volumes): it completes, namespaces first, while the kubelets stop our pods
    (the process test confirmed their deletions itself). On a run of its own: it deletes our CRDs
    and namespaces, which the shared run's baseline keeps."""
    run = start_real_nodes(tmp_path / "nodes", image, baseline=False)
    try:
        cluster = NodeCluster(run, tmp_path)
        overlay = tmp_path / "overlay"
        install(cluster, image.ref, overlay)
        cluster.kubectl("apply", "-f", str(REPO / "tests" / "cluster" / "crds"))  # KServe's InferenceService
        cluster.kubectl("wait", "--for", "condition=Established", "--timeout", "60s", "crd", "--all")
        admin = cluster.kube()
        with origin_for_pods(cluster) as origin:
            bucket = unique("models")
            uri = f"s3://{bucket}/llm"
            origin.put_model(bucket, "llm", shards=1, shard_bytes=1 << 20)
            origin.put_model(bucket, "llm-ns", shards=1, shard_bytes=1 << 20)
            account = s3_credentials(cluster, "modelcache-credentials", origin, kserve_config=False)
            # A namespace cache may use it once an admin grants it to the namespace (docs/install.md).
            cluster.kubectl("annotate", "serviceaccount", account, "-n", "modelcache-credentials",
                            "modelcache.io/namespaces=team")
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(node_group("workers")))
            cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(model_cache("llm", uri, ["workers"], account)))
            make_namespace(admin, "team")
            nscache = model_cache("nsllm", f"{uri}-ns", ["workers"], account)
            nscache["kind"], nscache["metadata"]["namespace"] = "LocalModelNamespaceCache", "team"
            cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(nscache))
            make_isvc(admin, "svc", "team", f"{uri}/v1")
            make_isvc(admin, "svc2", "team", f"{uri}-ns")
            wait_downloaded(cluster, "llm")
            wait_downloaded(cluster, "team/nsllm")

            def held() -> bool:
                lmc = admin.get(LOCAL_MODEL_CACHES, "llm")["metadata"].get("finalizers") or []
                lmnc = admin.get(LOCAL_MODEL_NAMESPACE_CACHES, "nsllm", "team")["metadata"].get("finalizers") or []
                entries = [len((admin.get_or_none(LOCAL_MODEL_NODES, n) or {}).get("spec", {}).get("localModels")
                               or []) for n in ("node-1", "node-2")]
                pvcs = admin.list(PERSISTENT_VOLUME_CLAIMS, "team").get("items") or []
                return CACHE_FINALIZER in lmc and NAMESPACE_CACHE_FINALIZER in lmnc and entries == [2, 2] and \
                    len(pvcs) == 2

            wait_until(held, timeout=120, what="finalizers, entries on both nodes and serving volumes")

            # The coordinators' logs, followed until their pods are gone.
            follow = subprocess.Popen([str(BIN / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "logs", "-f",
                                       "-n", NS, "-l", COORDINATOR,
                                       "--tail=-1", "--max-log-requests=4"], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            try:
                out = cluster.kubectl("delete", "-k", str(overlay), "--timeout", "180s", check=False, timeout=240)
            finally:
                follow.terminate()
                logs = follow.communicate(timeout=30)[0]
        assert out.returncode == 0, f"{out.stderr}\n{logs[-3000:]}"
        # Namespaces go first (kustomize's order), before the CRDs: see coordinator/uninstall.py.
        order = [line.split()[0] for line in out.stdout.splitlines()]
        assert order[:2] == ["namespace", "namespace"] and "customresourcedefinition.apiextensions.k8s.io" in order
        crds = json.loads(cluster.kubectl("get", "crd", "-o", "json").stdout)["items"]
        assert not [c for c in crds if c["spec"]["group"] == "serving.kserve.io" and
                    c["spec"]["names"]["plural"].startswith("localmodel")]
        # The serving volumes go with the caches (a PV once the PV controller has released it).
        selector = "app.kubernetes.io/managed-by=modelcache-coordinator"
        wait_until(lambda: not admin.list(PERSISTENT_VOLUMES, label_selector=selector).get("items"), timeout=60,
                   what="serving PVs deleted")
        assert not admin.list(PERSISTENT_VOLUME_CLAIMS, label_selector=selector).get("items")
        assert "released the finalizers of 2 caches" in logs, logs[-3000:]
        # Our pods were stopped by their kubelets: nothing of ours runs on either node.
        for node in run.nodes:
            wait_until(lambda node=node: not cgroups.pids(f"{node.cgroup_root}/kubepods"), timeout=120,
                       what=f"the pods of {node.name} stopped by its kubelet")
    finally:
        run.stop()
