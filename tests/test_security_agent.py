"""A compromised agent is not root anywhere (security review H1; docs/operations.md, "Threat
model"): with the agent's token, bound to a pod on node-1 as its DaemonSet pod's is, the
review's escape Job (privileged, host PID and network, the host's / mounted, on node-3) is refused
by the API server (deploy/policies/agent-jobs.yaml), and so is every way around it the Job spec
offers; the Job agent/downloadjob.py makes for its own node is admitted.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from agent.downloadjob import JOBS, job_body, secret_keys
from modelcache.kube.client import SECRETS, Kube
from modelcache.kube.types import LocalModelInfo
from modelcache.sources.uri import storage_key
from tests.agent_util import apply_agent_daemonset
from tests.fixtures.cluster import AGENT_SA, Cluster

pytestmark = pytest.mark.timeout(300)

JOBS_NS = "modelcache-jobs"
ROOT = "/models"  # deploy/'s hostroot


def escape_job(node_name: str = "node-3") -> dict[str, Any]:
    """The review's 03-agent-escalation.sh (a)."""
    pod = {"nodeName": node_name, "hostPID": True, "hostNetwork": True, "restartPolicy": "Never",
           "tolerations": [{"operator": "Exists"}],
           "containers": [{"name": "c", "image": "busybox", "command": ["chroot", "/host", "cat", "/etc/shadow"],
                           "securityContext": {"privileged": True},
                           "volumeMounts": [{"name": "host", "mountPath": "/host"}]}],
           "volumes": [{"name": "host", "hostPath": {"path": "/"}}]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "secrev-escape"},
            "spec": {"template": {"spec": pod}}}


def download_job(node: str, name: str = "llama-x") -> dict[str, Any]:
    """What agent/downloadjob.py creates for a model on ``node``."""
    csc = {"metadata": {"name": "private"}, "spec": {"container": {"name": "dl", "image": "registry.example.com/dl:1"}}}
    info = LocalModelInfo(model_name="llama", source_model_uri="private://models/llama")
    # Its env: a storage spec, and a ServiceAccount's https-host headers (KServe's "<host>-headers").
    body = job_body(csc, info, node, storage_key(info.source_model_uri), ROOT, None, name,
                    ["STORAGE_CONFIG", "127.0.0.1:18555-headers"])
    body["metadata"].pop("generateName")
    body["metadata"]["name"] = name
    return body


def refused(call: Any) -> str:
    with pytest.raises(ApiException) as info:
        call()
    body = info.value.body if isinstance(info.value.body, str) else info.value.body.decode()
    assert info.value.status in (403, 422) and "ValidatingAdmissionPolicy 'modelcache-agent-" in body, body
    return str(json.loads(body)["message"])


@pytest.fixture
def agents(cluster: Cluster) -> dict[str, Kube]:
    """node-1's and node-2's agents (model nodes), as their pods' tokens; node-3 is not a model node."""
    for node, labels in (("node-1", {"kserve/localmodel": "worker"}), ("node-2", {"kserve/localmodel": "worker"}),
                         ("node-3", {})):
        cluster.register_node(node, labels)
    apply_agent_daemonset(cluster, ROOT)
    return {node: cluster.kube(cluster.cp.kubeconfig_on_node(*AGENT_SA, node)) for node in ("node-1", "node-2")}


def test_the_escape_job_and_its_variants_are_refused(cluster: Cluster, agents: dict[str, Kube]) -> None:
    agent = agents["node-1"]
    # RBAC still says yes: the agent needs to create download Jobs. The policy decides which.
    can = cluster.kubectl("auth", "can-i", "create", "jobs.batch", "-n", JOBS_NS,
                          "--as", "system:serviceaccount:modelcache-system:modelcache-agent").stdout.strip()
    assert can == "yes"
    message = refused(lambda: agent.create(JOBS, escape_job(), JOBS_NS))
    assert "modelcache-agent on node-1" in message or "a download Job" in message, message
    assert not cluster.kube().list(JOBS, JOBS_NS).get("items")

    # Each way around, on an otherwise admitted Job.
    def variant(change: Any) -> dict[str, Any]:
        job = download_job("node-1")
        change(job["spec"]["template"]["spec"], job)
        return job

    pod_changes = {
        "another node": lambda s, j: s.update(nodeSelector={"kubernetes.io/hostname": "node-3"}),
        "its label lies": lambda s, j: j["metadata"]["labels"].update(node="node-2"),
        "nodeName": lambda s, j: s.update(nodeName="node-3"),
        "the host's /": lambda s, j: s["volumes"][0]["hostPath"].update(path="/"),
        "another host directory": lambda s, j: s["volumes"][0]["hostPath"].update(path="/etc"),
        "a second volume": lambda s, j: s["volumes"].append({"name": "s", "secret": {"secretName": "other-node-job"}}),
        "privileged": lambda s, j: s["containers"][0].update(securityContext={"privileged": True}),
        "a capability": lambda s, j: s["containers"][0].update(
            securityContext={"capabilities": {"add": ["SYS_ADMIN"]}}),
        "host PID": lambda s, j: s.update(hostPID=True),
        "host network": lambda s, j: s.update(hostNetwork=True),
        "a host port": lambda s, j: s["containers"][0].update(ports=[{"containerPort": 22, "hostPort": 22}]),
        "another subPath": lambda s, j: s["containers"][0]["volumeMounts"][0].update(subPath="models"),
        "an init container": lambda s, j: s.update(initContainers=[{**copy.deepcopy(s["containers"][0]), "name": "i"}]),
        "a ServiceAccount token": lambda s, j: s.update(automountServiceAccountToken=True),
        "another ServiceAccount": lambda s, j: s.update(serviceAccountName="job-controller"),
        "SELinux": lambda s, j: s.update(securityContext={"seLinuxOptions": {"type": "spc_t"}}),
        "another Job's Secret": lambda s, j: s["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"].update(
            name="other-node-job"),
        "a priority class": lambda s, j: s.update(priorityClassName="system-node-critical"),
    }
    for what, change in pod_changes.items():
        refused_why = refused(lambda c=change: agent.create(JOBS, variant(c), JOBS_NS))
        assert refused_why, what

    # A token bound to no pod (the review's `kubectl create token`) creates no Job at all.
    plain = cluster.kube(cluster.agent_kubeconfig)
    assert "bound to no node" in refused(lambda: plain.create(JOBS, download_job("node-1"), JOBS_NS))


def test_a_download_job_of_its_own_node_is_admitted_and_only_its_own_are_deleted(
        cluster: Cluster, agents: dict[str, Kube]) -> None:
    one, two = agents["node-1"], agents["node-2"]
    job = one.create(JOBS, download_job("node-1", "llama-node-1abc"), JOBS_NS)
    secret = {"metadata": {"name": "llama-node-1abc", "labels": {"model": "llama", "node": "node-1"},
                           "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "llama-node-1abc",
                                                "uid": job["metadata"]["uid"], "controller": True}]},
              "type": "Opaque", "stringData": {ref: "{}" for ref in secret_keys(
                  ["STORAGE_CONFIG", "127.0.0.1:18555-headers"]).values()}}
    # Its Secret: only Opaque, of its node, owned by the Job of that name.
    token = copy.deepcopy(secret)
    token.update(type="kubernetes.io/service-account-token")
    token["metadata"]["annotations"] = {"kubernetes.io/service-account.name": "default"}
    refused(lambda: one.create(SECRETS, token, JOBS_NS))
    refused(lambda: two.create(SECRETS, secret, JOBS_NS))
    one.create(SECRETS, secret, JOBS_NS)  # the review's side finding: "<host>:<port>-headers" was no valid key (422)
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "127.0.0.1:18555-headers", "valueFrom": {"secretKeyRef": {
        "name": "llama-node-1abc", "key": "env-0"}}} in env
    # The review's (d): another node's agent deletes the Job: refused; its own agent may.
    assert "is not of its node" in refused(lambda: two.delete(JOBS, "llama-node-1abc", JOBS_NS))
    one.delete(JOBS, "llama-node-1abc", JOBS_NS)
