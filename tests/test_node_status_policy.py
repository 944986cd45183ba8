"""Each node speaks only for itself (deploy/policies/node-status.yaml), on the real API server: a
ServiceAccount writes a LocalModelNode's status only with a token bound to a pod on the Node of
that name. What v1.37 puts in such a token is read back first (SelfSubjectReview, TokenReview),
from a pod the scheduler itself bound, as the kubelet's token for a DaemonSet pod would be."""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import pytest

from modelcache.kube.client import LOCAL_MODEL_NODES, NODES
from tests.agent_util import create_node, kube_for, node_status, start_agent
from tests.cluster.controlplane import kubeconfig_text
from tests.fixtures.cluster import AGENT_SA, Cluster
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(240)

NS, SA = AGENT_SA
NODE_NAME, NODE_UID = "authentication.kubernetes.io/node-name", "authentication.kubernetes.io/node-uid"


def scheduled_pod(cluster: Cluster, node: str, name: str) -> dict[str, Any]:
    """A pod of the agents' ServiceAccount that the scheduler binds to ``node`` (its hostname label)."""
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"serviceAccountName": SA, "automountServiceAccountToken": False,
                     "nodeSelector": {"kubernetes.io/hostname": node},
                     "containers": [{"name": "agent", "image": "localhost/modelcache-stand-in:never"}]}}
    status, text = cluster.cp.raw(f"/api/v1/namespaces/{NS}/pods", "POST", body)
    assert status == 201, text
    path = f"/api/v1/namespaces/{NS}/pods/{name}"

    def bound() -> bool:
        return bool(json.loads(cluster.cp.raw(path)[1])["spec"].get("nodeName"))

    wait_until(bound, timeout=60, what=f"the scheduler to bind pod {name}")
    pod = json.loads(cluster.cp.raw(path)[1])
    assert pod["spec"]["nodeName"] == node
    return dict(pod)


def as_token(cluster: Cluster, token: str, path: str, method: str = "GET", body: Any = None,
             content_type: str = "application/merge-patch+json") -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(cluster.server + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": content_type})
    # The CA only: with the admin's client certificate the API server would authenticate that.
    context = ssl.create_default_context(cafile=str(cluster.ca_file))
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def patch_status(cluster: Cluster, token: str, node: str, value: str) -> tuple[int, str]:
    status, doc = as_token(cluster, token, f"/apis/serving.kserve.io/v1alpha1/localmodelnodes/{node}/status",
                           "PATCH", {"status": {"peer": {"endpoint": value, "certSHA256": "0" * 64}}})
    return status, str(doc.get("message", ""))


def test_a_pods_token_names_its_node_and_the_api_server_hands_it_to_admission(cluster: Cluster) -> None:
    uid = cluster.register_node("node-a")["metadata"]["uid"]
    pod = scheduled_pod(cluster, "node-a", "agent-x")
    token = cluster.cp.token(NS, SA, pod=pod)
    status, review = as_token(cluster, token, "/apis/authentication.k8s.io/v1/selfsubjectreviews", "POST",
                              {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
                              "application/json")
    assert status == 201, review
    user = review["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{NS}:{SA}"
    # What v1.37 puts there for a pod-bound token: the pod and its node, by name and uid.
    assert user["extra"][NODE_NAME] == ["node-a"] and user["extra"][NODE_UID] == [uid]
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == ["agent-x"]
    # The peer token (audience modelcache-peer, projected from the same pod) carries it too: a
    # peer server's TokenReview learns which node asks.
    peer = cluster.cp.token(NS, SA, audiences=["modelcache-peer"], pod=pod)
    status, text = cluster.cp.raw("/apis/authentication.k8s.io/v1/tokenreviews", "POST", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
        "spec": {"token": peer, "audiences": ["modelcache-peer"]}})
    assert status == 201, text
    reviewed = json.loads(text)["status"]
    assert reviewed["authenticated"] and reviewed["user"]["extra"][NODE_NAME] == ["node-a"]
    # A token bound to no pod names no node.
    unbound = cluster.cp.token(NS, SA)
    _, review = as_token(cluster, unbound, "/apis/authentication.k8s.io/v1/selfsubjectreviews", "POST",
                         {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}, "application/json")
    assert NODE_NAME not in (review["status"]["userInfo"].get("extra") or {})


def test_an_agents_token_writes_its_own_nodes_status_and_no_other(cluster: Cluster) -> None:
    kube = kube_for(cluster)
    for node in ("node-a", "node-b"):
        cluster.register_node(node)
        create_node(kube, node, [])
    token_a = cluster.cp.token(NS, SA, pod=scheduled_pod(cluster, "node-a", "agent-a"))

    status, message = patch_status(cluster, token_a, "node-a", "10.0.0.1:8443")
    assert status == 200, message
    # Another node's status: refused by the policy, with a message naming both nodes.
    status, message = patch_status(cluster, token_a, "node-b", "10.6.6.6:8443")
    assert status == 403, message
    assert "ValidatingAdmissionPolicy 'modelcache-node-status'" in message
    assert ("LocalModelNode node-b: its status is written only from a pod on Node node-b; "
            f"system:serviceaccount:{NS}:{SA} runs on Node node-a") in message, message
    # A LocalModelNode of a node that has no agent (or no Node at all) neither.
    kube.create(LOCAL_MODEL_NODES, {"metadata": {"name": "ghost"}, "spec": {"localModels": []}})
    assert patch_status(cluster, token_a, "ghost", "10.6.6.6:8443")[0] == 403
    # The same ServiceAccount's token bound to no pod (TokenRequest by an admin, a legacy Secret).
    status, message = patch_status(cluster, cluster.cp.token(NS, SA), "node-a", "10.6.6.6:8443")
    assert status == 403 and "has a token bound to no node" in message, message
    # Nothing of that reached the objects; a person (the admin) still may.
    assert node_status(kube, "node-b").get("peer") is None
    assert node_status(kube, "node-a")["peer"]["endpoint"] == "10.0.0.1:8443"
    kube.patch_status(LOCAL_MODEL_NODES, "node-b", {"status": {"peer": {"endpoint": "10.0.0.2:8443"}}})
    assert node_status(kube, "node-b")["peer"]["endpoint"] == "10.0.0.2:8443"


def test_the_reviews_forged_model_status_is_refused(cluster: Cluster) -> None:
    """The security review's M3 (security-scripts/03-agent-escalation.sh (c), 12-forge-peer-status.sh):
    with the agents' token (as `kubectl create token` makes it, and as node-1's own pod has it) a
    merge patch of node-2's status, stamped with node-2's uid, says a model node-2 never downloaded
    is ModelDownloaded. Both are refused and node-2's status stays what its own agent wrote."""
    kube = kube_for(cluster)
    for node in ("node-1", "node-2"):
        cluster.register_node(node)
        create_node(kube, node, [{"modelName": "victim", "sourceModelUri": "s3://bucket/victim"}])
    uid2 = kube.get(NODES, "node-2")["metadata"]["uid"]
    own = {"nodeUID": uid2, "modelStatus": {"victim": "ModelDownloadError"}}
    token_2 = cluster.cp.token(NS, SA, pod=scheduled_pod(cluster, "node-2", "agent-2"))
    path = "/apis/serving.kserve.io/v1alpha1/localmodelnodes/node-2/status"
    status, doc = as_token(cluster, token_2, path, "PATCH", {"status": own})
    assert status == 200, doc  # node-2's own agent
    forged = {"status": {"nodeUID": uid2, "modelStatus": {"victim": "ModelDownloaded"},
                         "modelDetails": {"victim": {"state": "ModelDownloaded"}}}}
    token_1 = cluster.cp.token(NS, SA, pod=scheduled_pod(cluster, "node-1", "agent-1"))
    for token, who in ((cluster.cp.token(NS, SA), "has a token bound to no node"), (token_1, "runs on Node node-1")):
        status, doc = as_token(cluster, token, path, "PATCH", forged)
        assert status == 403, doc
        assert ("LocalModelNode node-2: its status is written only from a pod on Node node-2; "
                f"system:serviceaccount:{NS}:{SA} {who}") in doc["message"], doc
    assert node_status(kube, "node-2")["modelStatus"] == {"victim": "ModelDownloadError"}


def test_an_agent_claiming_another_node_cannot_speak_for_it(cluster: Cluster, tmp_path: Path) -> None:
    """A compromised agent on node-a runs with node-a's token and says it is node-b: node-b's status
    never changes, and the agent's log names the refusal."""
    kube = kube_for(cluster)
    for node in ("node-a", "node-b"):
        cluster.register_node(node)
        create_node(kube, node, [])
    kubeconfig = tmp_path / "agent-a.kubeconfig"
    token = cluster.cp.token(NS, SA, pod=scheduled_pod(cluster, "node-a", "agent-a"))
    kubeconfig.write_text(kubeconfig_text(cluster.server, cluster.ca_file, {"token": token}, NS))
    honest = start_agent(cluster.agent_kubeconfig, "node-a", tmp_path / "root-a", tmp_path)  # bound to node-a
    liar = start_agent(kubeconfig, "node-b", tmp_path / "root-b", tmp_path, name="liar")
    try:
        wait_until(lambda: bool(node_status(kube, "node-a")), timeout=60, what="node-a's agent to write its status")
        wait_until(lambda: "its status is written only from a pod on Node node-b" in liar.log(), timeout=60,
                   what="the refusal in the log")
        assert node_status(kube, "node-b") == {}
    finally:
        honest.stop()
        liar.stop()
