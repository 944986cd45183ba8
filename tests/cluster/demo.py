"""`make demo`, cluster part: modelcache's main job on a local Kubernetes cluster whose nodes run pods.

1. Start the control plane and two real nodes (a kubelet and a containerd each, built from Go
   modules on the first run: tests/cluster/realnodes.py) and a third, API-only Node; the project
   image (`make image`) and our serving image loaded into the nodes.
2. `kubectl apply -k` deploy/ through an overlay that only sets the image reference: the agent
   DaemonSet's pods run on the two labelled nodes, the coordinator's two replicas beside them, the
   webhooks are called through their Service.
3. Create S3 credentials as KServe takes them, a LocalModelNodeGroup and a LocalModelCache of one
   multi-file model (safetensors shards and json) in a local S3 server (moto) that pods reach at
   this machine's link address, and print `kubectl get localmodelcaches,localmodelnodes` as the
   agent pods fill their nodes' /models.
4. Create an InferenceService (KServe's CRD; KServe itself is not installed here) and its
   predictor pod as KServe makes it after its local-model rewrite: the serving container reads the
   model from the cache's PVC. Our webhook pins it to a node that holds the model, the scheduler
   binds it, the kubelet runs it; it is Ready once it read every file, and its log says what it read.
5. Stop everything and leave the machine as it was.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from examples.demo import make_model
from modelcache.sources.uri import storage_key
from tests.cluster.controlplane import ControlPlane, free_port
from tests.cluster.images import podman_archive, project_image, static_image
from tests.cluster.realnodes import RealNodes

REPO = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("MODELCACHE_DEMO_DIR", REPO / ".work" / "demo")).resolve() / "cluster"
GROUP_LABEL = ("kserve/localmodel", "worker")
SA_NAMESPACE = "modelcache-system"
#: deploy/'s credential namespace: the only one whose Secrets the agent may read.
CREDENTIALS_NAMESPACE = "modelcache-credentials"
S3_KEY = ("demo-access-key", "demo-secret-key")


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def kubectl_shown(cp: ControlPlane, *args: str, input: str | None = None) -> str:
    print(f"$ kubectl {' '.join(shlex.quote(a) for a in args)}", flush=True)
    out = cp.kubectl(*args, input=input).stdout
    print(out, end="" if out.endswith("\n") else "\n", flush=True)
    return out


def status_shown(cp: ControlPlane) -> str:
    """`modelcache status`: the fleet at a glance, as a person runs it (README.md shows this output)."""
    print("$ modelcache status", flush=True)
    out = subprocess.run([sys.executable, "-m", "modelcache", "status", "--kubeconfig", str(cp.kubeconfig)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    print(out.stdout + out.stderr, end="", flush=True)
    return out.stdout


def wait(what: str, check: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: {what} did not happen within {timeout:.0f} s (logs in {WORK})")
        time.sleep(0.5)


class CopiesShown:
    """One poll of the wait for two copies: ``kubectl get localmodelcaches,localmodelnodes`` printed
    when it changed (what a user watches), ``modelcache status`` once while the copies are in flight.

    The copies are read first and the table after, so the table printed last is never older than
    the answer. kubectl names each object with its kind (``localmodelcache.serving.kserve.io/llm``)
    only when objects of two kinds come back (kubectl's get.go, ``multipleGVKsRequested``): with the
    table read first, a small model that arrived within one poll left only a table of the cache
    before any LocalModelNode, a plain ``llm`` row (CI, stop 37; tests/test_cluster_demo.py plays it)."""

    def __init__(self, cp: Any) -> None:
        self.cp, self.last, self.in_flight_shown = cp, "", False

    def __call__(self) -> bool:
        copies = yaml.safe_load(self.cp.kubectl("get", "localmodelcache", "llm", "-o", "yaml").stdout)
        available = ((copies.get("status") or {}).get("copies") or {}).get("available") == 2
        now = self.cp.kubectl("get", "localmodelcaches,localmodelnodes").stdout
        if now != self.last:
            print(f"[{time.strftime('%H:%M:%S')}]\n{now}", flush=True)
            self.last = now
        if not available and not self.in_flight_shown and \
                "ModelDownloading" in self.cp.kubectl("get", "localmodelnodes", "-o", "yaml").stdout:
            self.in_flight_shown = True
            status_shown(self.cp)  # once, while the copies are in flight: rates and ETA
        return available


def model_in_s3(folder: Path, host: str) -> tuple[Any, str, int, list[str]]:
    """The sample model (safetensors shards + json) uploaded to a local S3 server (moto) on ``host``."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request

    os.environ.setdefault("MODELCACHE_DEMO_SHARD_MB", "64")
    src = folder / "llm"
    names = make_model(src)
    port = free_port()
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    s3 = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                      aws_access_key_id=S3_KEY[0], aws_secret_access_key=S3_KEY[1])
    s3.create_bucket(Bucket="models")
    size = 0
    for name in names:
        with open(src / name, "rb") as body:
            s3.put_object(Bucket="models", Key=f"llm/{name}", Body=body)
        size += (src / name).stat().st_size
    print(f"a model of {len(names)} files ({size >> 20} MiB: safetensors shards + json) in s3://models/llm "
          f"on a local S3 server (moto) at {host}:{port}, where pods reach this machine")
    return server, f"{host}:{port}", size, names


def overlay(ref: str) -> Path:
    """deploy/ with the image reference set to the image built here (nothing else changes)."""
    from tests.deploy_util import image_overlay

    return image_overlay(Path(tempfile.mkdtemp(prefix="overlay-", dir=WORK)), ref)


def main() -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    say("a local cluster: control plane, two real nodes (kubelet + containerd) and an API-only Node")
    started = time.monotonic()
    shutil.rmtree(WORK / "run", ignore_errors=True)  # the previous run's data, certificates and logs
    ref = os.environ.get("IMAGE") or project_image()
    run = RealNodes(WORK / "run", nodes=3, kubelets=2, images=[podman_archive(ref)])
    server = None
    try:
        run.start()
        cp = run.cp
        assert cp is not None
        for node in ("node-1", "node-2"):
            cp.kubectl("label", "node", node, f"{GROUP_LABEL[0]}={GROUP_LABEL[1]}")
        print(f"ready in {time.monotonic() - started:.1f} s; kubeconfig: {cp.kubeconfig}")
        kubectl_shown(cp, "version")
        kubectl_shown(cp, "get", "nodes", "-o", "wide", "-L", GROUP_LABEL[0])

        say(f"install: kubectl apply --server-side -k <deploy/ with the image {ref}>")
        cp.kubectl("apply", "--server-side", "-k", str(overlay(ref)))
        # KServe itself is not installed here: its InferenceService CRD stands in (a minimal schema).
        cp.kubectl("apply", "--server-side", "-f", str(REPO / "tests" / "cluster" / "crds"))
        cp.kubectl("wait", "--for", "condition=Established", "crd", "--all", "--timeout", "60s")
        cp.kubectl("rollout", "status", "-n", SA_NAMESPACE, "daemonset/modelcache-agent", "--timeout=300s",
                   timeout=330)
        cp.kubectl("rollout", "status", "-n", SA_NAMESPACE, "deployment/modelcache-coordinator",
                   "--timeout=300s", timeout=330)
        kubectl_shown(cp, "get", "pods", "-n", SA_NAMESPACE, "-o", "wide")

        server, endpoint, size, _ = model_in_s3(WORK, run.host_ip)
        uri = "s3://models/llm"
        say(f"credentials as KServe takes them, a node group, and a LocalModelCache of {uri}")
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {
            "name": "demo-s3", "namespace": CREDENTIALS_NAMESPACE, "annotations": {
                "serving.kserve.io/s3-endpoint": endpoint, "serving.kserve.io/s3-usehttps": "0",
                "serving.kserve.io/s3-region": "us-east-1"}},
            "stringData": {"awsAccessKeyID": S3_KEY[0], "awsSecretAccessKey": S3_KEY[1]}}
        account = {"apiVersion": "v1", "kind": "ServiceAccount",
                   "metadata": {"name": "demo-models", "namespace": CREDENTIALS_NAMESPACE},
                   "secrets": [{"name": "demo-s3"}]}
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([secret, account]))
        print(f"secret/demo-s3 (S3 keys, endpoint annotation) and serviceaccount/demo-models in "
              f"{CREDENTIALS_NAMESPACE}")
        group = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNodeGroup",
                 "metadata": {"name": "workers"}, "spec": {
                     "storageLimit": "10Gi",
                     "persistentVolumeSpec": {
                         "accessModes": ["ReadWriteOnce"], "volumeMode": "Filesystem", "capacity": {"storage": "10Gi"},
                         "local": {"path": "/models"}, "persistentVolumeReclaimPolicy": "Delete",
                         "storageClassName": "local-storage",
                         "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                             {"key": GROUP_LABEL[0], "operator": "In", "values": [GROUP_LABEL[1]]}]}]}}},
                     "persistentVolumeClaimSpec": {
                         "accessModes": ["ReadWriteOnce"], "storageClassName": "local-storage",
                         "resources": {"requests": {"storage": "10Gi"}}}}}
        cache = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache", "metadata": {"name": "llm"},
                 "spec": {"sourceModelUri": uri, "modelSize": f"{(size >> 20) + 1}Mi", "nodeGroups": ["workers"],
                          "serviceAccountName": "demo-models"}}
        kubectl_shown(cp, "apply", "-f", "-", input=yaml.safe_dump_all([group, cache]))

        say("kubectl get localmodelcaches,localmodelnodes  (as the agent pods fill their nodes)")
        wait("two copies available", CopiesShown(cp), 300)
        say("modelcache status  (the fleet at a glance)")
        status_shown(cp)

        say("an InferenceService that uses the cache, and its predictor pod as KServe makes it")
        kubectl_shown(cp, "create", "namespace", "demo")
        isvc = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
                "metadata": {"name": "llm", "namespace": "demo"},
                "spec": {"predictor": {"model": {"modelFormat": {"name": "huggingface"}, "storageUri": uri}}}}
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(isvc))
        wait("the default ServiceAccount of the namespace",
             lambda: cp.kubectl("get", "sa", "default", "-n", "demo", check=False).returncode == 0, 60)
        wait("the cache's serving PVC llm-workers, made by the coordinator", lambda: cp.kubectl(
            "get", "pvc", "llm-workers", "-n", "demo", check=False).returncode == 0, 60)
        key = storage_key(uri)
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "llm-predictor-0", "namespace": "demo",
            "labels": {"serving.kserve.io/inferenceservice": "llm", "internal.serving.kserve.io/localmodel": "llm"},
            "annotations": {"internal.serving.kserve.io/storage-initializer-sourceuri": uri}},
            "spec": {"containers": [{
                "name": "kserve-container", "image": static_image("serve").ref,
                "args": ["--model-name=llm", "--model-dir=/mnt/models", "--digest=none"],
                "readinessProbe": {"httpGet": {"path": "/v1/models/llm", "port": 8080}, "periodSeconds": 1},
                "volumeMounts": [{"name": "kserve-pvc-source", "mountPath": "/mnt/models", "readOnly": True,
                                  "subPath": f"models/{key}/"}]}],
                "volumes": [{"name": "kserve-pvc-source", "persistentVolumeClaim": {"claimName": "llm-workers",
                                                                                    "readOnly": True}}]}}
        kubectl_shown(cp, "create", "-f", "-", input=yaml.safe_dump(pod))
        wait("the predictor pod Ready", lambda: cp.kubectl(
            "get", "pod", "llm-predictor-0", "-n", "demo", "-o",
            "jsonpath={.status.conditions[?(@.type=='Ready')].status}").stdout == "True", 180)
        kubectl_shown(cp, "get", "pod", "llm-predictor-0", "-n", "demo", "-o", "wide")
        node = cp.kubectl("get", "pod", "llm-predictor-0", "-n", "demo", "-o", "jsonpath={.spec.nodeName}").stdout
        kubectl_shown(cp, "logs", "llm-predictor-0", "-n", "demo")
        on_disk = json.loads(cp.kubectl("get", "localmodelnode", node, "-o", "json").stdout)
        state = (on_disk.get("status") or {}).get("modelStatus", {}).get("llm")
        print(f"running on {node}, whose agent reports the model {state} (files under its /models/models/{key}); "
              f"node-3 is outside the group and has no copy")
        return 0
    finally:
        say("stopping the pods, the nodes and the control plane")
        if server is not None:
            server.stop()
        run.stop()
        print("stopped")


if __name__ == "__main__":
    sys.exit(main())
