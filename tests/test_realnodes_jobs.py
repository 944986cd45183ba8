"""KServe's ``localModelDownloadJob`` ClusterStorageContainers on real nodes: for a URI none of our
sources reads, the agent pod (deploy/ installed as pods) runs the container as KServe's agent does,
a Job per model on that node (args ``[uri, /mnt/models]``, the model's folder of the node's host
folder mounted there), and the node's kubelet runs its pod: the container writes the model, its
exit code ends the Job, and the agent reports the model Downloaded with a manifest, or an Error
naming the Job. This was a process test that wrote the container's files and its pod's end
itself (tests/test_agent_download_job.py keeps what needs no pod to run).

The download container is the project image with a short Python program as its command (an admin's
ClusterStorageContainer names any image; no registry is reachable here). It waits for a go-ahead
file so the test sees the model Downloading while the pod runs, prints a digest of the access key
it was given, then writes the model; for a ``corp+`` URI it fails."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.fixtures.image import Image
from tests.fixtures.realnodes import NodeCluster
from tests.helpers import wait_until
from tests.realnodes_util import AGENT_PODS, install, model_states, node_group

pytestmark = [pytest.mark.xdist_group("realnodes"), pytest.mark.timeout(600)]
NS = "modelcache-system"
JOBS_NS = "modelcache-jobs"
CREDENTIALS_NS = "modelcache-credentials"
WEIGHTS = bytes(range(256)) * 390 + bytes(160)  # 100,000 bytes

DOWNLOADER = r"""
import hashlib, json, os, sys, time
uri, dest = sys.argv[1], sys.argv[2]
if uri.startswith("corp+"):
    sys.exit(f"downloader: no such model {uri}")
if os.environ.get("MIRROR") != "eu":
    sys.exit("downloader: not the settings of the ClusterStorageContainer")
key_id = json.loads(os.environ["STORAGE_CONFIG"])["access_key_id"]
print("downloader: access key sha256:" + hashlib.sha256(key_id.encode()).hexdigest(), flush=True)
go = os.path.join(dest, ".go")
deadline = time.monotonic() + 300
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("downloader: no go-ahead")
    time.sleep(0.2)
os.unlink(go)
os.makedirs(os.path.join(dest, "weights"), exist_ok=True)
with open(os.path.join(dest, "config.json"), "wb") as f:
    f.write(b"{}")
with open(os.path.join(dest, "weights", "w.bin"), "wb") as f:
    f.write(bytes(range(256)) * 390 + bytes(160))
print(f"downloader: wrote {uri} into {dest}", flush=True)
"""



def containers(image: Image) -> list[dict[str, Any]]:
    """The download-Job container for ``private://`` and ``corp+<x>://``, and an init-container one
    for the same prefix (not a download Job: never used by the agent)."""
    return [{"apiVersion": "serving.kserve.io/v1alpha1", "kind": "ClusterStorageContainer",
             "metadata": {"name": "private-downloader"},
             "spec": {"workloadType": "localModelDownloadJob",
                      "supportedUriFormats": [{"prefix": "private://"}, {"regex": "^corp\\+[a-z]+://"}],
                      "container": {"name": "downloader", "image": image.ref, "command": ["python3", "-c", DOWNLOADER],
                                    "env": [{"name": "MIRROR", "value": "eu"}]}}},
            {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "ClusterStorageContainer",
             "metadata": {"name": "a-init"},
             "spec": {"supportedUriFormats": [{"prefix": "private://"}],
                      "container": {"name": "init", "image": "registry.example.com/init:1"}}}]


def cache(name: str, uri: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache", "metadata": {"name": name},
            "spec": {"sourceModelUri": uri, "modelSize": "1Mi", "nodeGroups": ["first"], **spec}}


def job_pod(cluster: NodeCluster, model: str) -> dict[str, Any]:
    """The pod of ``model``'s download Job on node-1, once the scheduler bound it there."""
    found: list[dict[str, Any]] = []

    def bound() -> bool:
        items = cluster.get(f"/api/v1/namespaces/{JOBS_NS}/pods?labelSelector=model%3D{model},node%3Dnode-1")["items"]
        found[:] = [p for p in items if p["spec"].get("nodeName") == "node-1"]
        return bool(found)

    wait_until(bound, timeout=120, what=f"the download Job's pod of {model} on node-1")
    return found[0]


def test_a_download_job_runs_on_the_node_and_its_end_is_reported(real_nodes: NodeCluster, image: Image,
                                                                 tmp_path: Path) -> None:
    install(real_nodes, image.ref, tmp_path / "overlay")
    real_nodes.apply(*containers(image))
    real_nodes.apply({"apiVersion": "v1", "kind": "Secret",
                       "metadata": {"name": "storage-config", "namespace": CREDENTIALS_NS},
                       "stringData": {"corp": '{"type": "s3", "access_key_id": "AK1"}'}})
    uri, bad_uri = "private://models/llama-7b", "corp+vault://models/broken"
    key = storage_key(uri)
    real_nodes.apply(node_group("first", nodes=["node-1"]), cache("llama", uri, storage={"key": "corp"}),
          cache("broken", bad_uri))

    pod = job_pod(real_nodes, "llama")
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert c["image"] == image.ref and c["args"] == [uri, "/mnt/models"]
    assert {"name": "MIRROR", "value": "eu"} in c["env"]
    assert {"name": "kserve-pvc-source", "mountPath": "/mnt/models", "subPath": f"models/{key}"} in c["volumeMounts"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kserve-pvc-source"]["hostPath"] == {"path": "/models", "type": "Directory"}
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": "node-1"} and spec["restartPolicy"] == "Never"
    job = pod["metadata"]["labels"]["job-name"]
    assert job.startswith("llama-node-1")
    (owner,) = real_nodes.get(f"/apis/batch/v1/namespaces/{JOBS_NS}/jobs/{job}")["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("LocalModelNode", "node-1")  # as KServe's Jobs
    # The download's credentials, as environment variables from a Secret of the Job's name, never
    # in the Job itself; the container says it got them.
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "STORAGE_CONFIG"]
    secret = real_nodes.get(f"/api/v1/namespaces/{JOBS_NS}/secrets/{job}")
    assert ref["name"] == job and ref["key"] in (secret.get("data") or {})
    assert "envFrom" not in c and spec["automountServiceAccountToken"] is False
    assert "AK1" not in json.dumps(pod)

    # The kubelet runs it: the container waits for its go-ahead in the folder it mounts, which is
    # the model's folder of node-1's host folder. Meanwhile the model is Downloading.
    folder = real_nodes.node("node-1").host_path("/models") / "models" / key
    wait_until(lambda: real_nodes.get(f"/api/v1/namespaces/{JOBS_NS}/pods/{pod['metadata']['name']}")["status"].get(
        "phase") == "Running", timeout=120, what="the download Job's pod Running")
    assert model_states(real_nodes, "node-1")["llama"] == "ModelDownloading"
    assert folder.is_dir()
    (folder / ".go").touch()
    wait_until(lambda: model_states(real_nodes, "node-1").get("llama") == "ModelDownloaded", timeout=120,
               what="llama Downloaded after its Job")
    status = real_nodes.get("/apis/serving.kserve.io/v1alpha1/localmodelnodes/node-1")["status"]
    assert status["modelDetails"]["llama"]["bytesTotal"] == 100_002
    assert (folder / "config.json").read_bytes() == b"{}" and (folder / "weights" / "w.bin").read_bytes() == WEIGHTS
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "weights"]  # the go-ahead is gone
    store = NodeStore.at(real_nodes.node("node-1").host_path("/models"))
    assert store.is_present(key) and store.verify(key) == []  # checked like any other model from now on
    done = real_nodes.get(f"/apis/batch/v1/namespaces/{JOBS_NS}/jobs/{job}")["status"]
    assert done.get("succeeded") == 1 and not done.get("failed")
    logs = real_nodes.kubectl("logs", "-n", JOBS_NS, f"job/{job}").stdout
    assert f"downloader: wrote {uri} into /mnt/models" in logs
    assert f"downloader: access key sha256:{hashlib.sha256(b'AK1').hexdigest()}" in logs  # the Secret reached it

    # A container that fails (exit 1): its Job's pod Failed, and the model is an Error naming the
    # Job and the container (KServe: failed > 0).
    bad = job_pod(real_nodes, "broken")
    wait_until(lambda: model_states(real_nodes, "node-1").get("broken") == "ModelDownloadError", timeout=180,
               what="broken a download Error after its Job's pod failed")
    status = real_nodes.get("/apis/serving.kserve.io/v1alpha1/localmodelnodes/node-1")["status"]
    message = status["modelDetails"]["broken"]["message"]
    assert bad["metadata"]["labels"]["job-name"].startswith("broken-node-1")
    assert f"download Job {JOBS_NS}/broken-node-1" in message, message
    assert "private-downloader" in message, message
    agent = real_nodes.kubectl("logs", "-n", NS, "-l", AGENT_PODS, "-c", "agent", "--tail=-1").stdout
    assert "AK1" not in agent and "download Job succeeded" in agent
