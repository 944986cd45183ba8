"""Helpers for tests of KServe predictor pods on real nodes: an S3 origin pods can reach (SeaweedFS
behind a relay that counts what it sends), models of safetensors shards in it, KServe's credentials
for it, and our serving runtime."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import yaml

from tests.cluster.images import static_image
from tests.counting_relay import CountingRelay
from tests.fixtures.realnodes import NodeCluster
from tests.helpers import free_port
from tests.node_util import safetensors

RUNTIME = "modelcache-serve"
ACCESS_KEY, SECRET_KEY = "test-key", "test-secret"  # moto takes any
MODEL_FORMAT = "safetensors"
AGENT_PODS = "app.kubernetes.io/name=modelcache-agent"


@dataclass
class Origin:
    """An S3 server (moto) on the nodes' link address, reached through a counting relay."""

    relay: CountingRelay
    direct: str  # the server's own endpoint (for uploads: not counted)

    @property
    def endpoint(self) -> str:
        return self.relay.endpoint

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.direct, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, config=Config(s3={"addressing_style": "path"}))

    def put_model(self, bucket: str, prefix: str, shards: int, shard_bytes: int) -> dict[str, str]:
        """A model of ``shards`` safetensors files (each ~``shard_bytes``) and a config.json;
        {file: sha256}."""
        s3 = self.client()
        s3.create_bucket(Bucket=bucket)
        digests = {}
        width = max(1, shard_bytes // 4 // 1024)
        for i in range(shards):
            data = safetensors({f"layer{i}.weight": ("F32", [1024, width])}, fill=i + 1)
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
            digests[name] = hashlib.sha256(data).hexdigest()
        config = json.dumps({"architectures": ["Test"], "shards": shards}).encode()
        s3.put_object(Bucket=bucket, Key=f"{prefix}/config.json", Body=config)
        digests["config.json"] = hashlib.sha256(config).hexdigest()
        return digests


@contextmanager
def origin_for_pods(cluster: NodeCluster, rate: int = 0) -> Iterator[Origin]:
    """``rate``: bytes per second the relay lets through (0: no limit), to keep a download under
    way long enough for a test to act on it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address=cluster.host_ip, port=port, verbose=False)
    server.start()
    relay = CountingRelay(cluster.host_ip, (cluster.host_ip, port), rate=rate)
    try:
        yield Origin(relay, f"http://{cluster.host_ip}:{port}")
    finally:
        relay.close()
        server.stop()


def s3_credentials(cluster: NodeCluster, namespace: str, origin: Origin, name: str = "models-s3",
                   kserve_config: bool = True) -> str:
    """A Secret and ServiceAccount as KServe takes S3 credentials (endpoint annotations); the
    ServiceAccount's name. The Secret's keys are spelled as KServe's shipped ConfigMap reads them
    (``kserve_config``, what `kserve.install` applies), else as its code's default reads them (a
    cluster without KServe): a Secret of the other spelling is skipped, by KServe and by us."""
    from agent.credentials import S3_KEY_SPELLINGS

    access, secret_key = S3_KEY_SPELLINGS[1 if kserve_config else 0]
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": name, "namespace": namespace, "annotations": {
            "serving.kserve.io/s3-endpoint": origin.endpoint, "serving.kserve.io/s3-usehttps": "0",
            "serving.kserve.io/s3-region": "us-east-1"}},
        "stringData": {access: ACCESS_KEY, secret_key: SECRET_KEY}}
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace},
               "secrets": [{"name": name}]}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([secret, account]))
    return name


def serving_runtime(digest: str = "sha256") -> dict[str, Any]:
    """A ClusterServingRuntime of our serving image (tests/cluster/runtime/cmd/serve): reads every
    file of /mnt/models, checks safetensors headers, Ready at /v2/health/ready."""
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "ClusterServingRuntime",
            "metadata": {"name": RUNTIME}, "spec": {
                "supportedModelFormats": [{"name": MODEL_FORMAT, "autoSelect": True}],
                "containers": [{"name": "kserve-container", "image": static_image("serve").ref,
                                "args": ["--model-name={{.Name}}", "--model-dir=/mnt/models", f"--digest={digest}"],
                                "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                                "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": 8080},
                                                   "periodSeconds": 1},
                                "resources": {"requests": {"cpu": "50m", "memory": "32Mi"},
                                              "limits": {"cpu": "1", "memory": "256Mi"}}}]}}


def inference_service(name: str, namespace: str, uri: str, service_account: str | None) -> dict[str, Any]:
    predictor: dict[str, Any] = {"model": {"modelFormat": {"name": MODEL_FORMAT}, "runtime": RUNTIME,
                                           "storageUri": uri}}
    if service_account:
        predictor["serviceAccountName"] = service_account
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"predictor": predictor}}


def served_files(log: str) -> dict[str, str]:
    """{file: sha256} from the serving container's log lines."""
    out = {}
    for line in log.splitlines():
        if line.startswith("serve: file ") and " sha256:" in line:
            parts = line.split()
            out[parts[2]] = parts[-1].split(":", 1)[1]
    return out


def node_group(name: str, size: str = "2Gi", path: str = "/models", nodes: list[str] | None = None) -> dict[str, Any]:
    """A LocalModelNodeGroup whose PVs are ``local`` at ``path`` (the agent DaemonSet's host path)
    on KServe's local-model nodes, or on the named ``nodes`` only."""
    term = ({"key": "kubernetes.io/hostname", "operator": "In", "values": nodes} if nodes
            else {"key": "kserve/localmodel", "operator": "In", "values": ["worker"]})
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNodeGroup",
            "metadata": {"name": name}, "spec": {"storageLimit": size, "persistentVolumeSpec": {
                "accessModes": ["ReadWriteOnce"], "capacity": {"storage": size}, "local": {"path": path},
                "storageClassName": "local-storage", "persistentVolumeReclaimPolicy": "Delete",
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [term]}]}}},
                "persistentVolumeClaimSpec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "local-storage",
                                              "resources": {"requests": {"storage": size}}}}}


def model_cache(name: str, uri: str, groups: list[str], service_account: str | None, size: str = "128Mi"
                ) -> dict[str, Any]:
    spec: dict[str, Any] = {"sourceModelUri": uri, "modelSize": size, "nodeGroups": groups}
    if service_account:
        spec["serviceAccountName"] = service_account
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache", "metadata": {"name": name},
            "spec": spec}


def model_states(cluster: NodeCluster, node: str) -> dict[str, str]:
    """The agent's modelStatus on ``node``'s LocalModelNode: {status key: state}."""
    status, body = cluster.cp.raw(f"/apis/serving.kserve.io/v1alpha1/localmodelnodes/{node}")
    if status != 200:
        return {}
    return {k: v if isinstance(v, str) else v.get("state", "") for k, v in
            ((json.loads(body).get("status") or {}).get("modelStatus") or {}).items()}


def sha256_files(folder: Any) -> dict[str, str]:
    """{file: sha256} of the files of a folder (a model as a node holds it)."""
    out = {}
    for path in folder.iterdir():
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        out[path.name] = h.hexdigest()
    return out


def wait_downloaded(cluster: NodeCluster, key: str, nodes: tuple[str, ...] = ("node-1", "node-2"),
                    timeout: float = 300) -> None:
    """Until each node's agent reports ``key`` ModelDownloaded; else the states and the agents' logs."""
    import time

    for node in nodes:
        deadline = time.monotonic() + timeout
        while model_states(cluster, node).get(key) != "ModelDownloaded":
            if time.monotonic() > deadline:
                logs = cluster.kubectl("logs", "-n", "modelcache-system", "-l", AGENT_PODS, "-c", "agent",
                                       "--tail=40", "--prefix", check=False).stdout
                raise AssertionError(f"{key} not downloaded on {node} after {timeout:.0f} s: states "
                                     f"{model_states(cluster, node)}; the agents' logs end:\n{logs}")
            time.sleep(0.5)


def install(cluster: NodeCluster, image_ref: str, folder: Any, host_root: str | None = None) -> None:
    """deploy/ as pods (an overlay in ``folder`` setting the image, and the host root if given),
    until the agents and both coordinators are rolled out."""
    from tests.deploy_util import image_overlay

    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-k",
                    str(image_overlay(folder, image_ref, host_root)))
    for what in ("daemonset/modelcache-agent", "deployment/modelcache-coordinator"):
        cluster.kubectl("rollout", "status", "-n", "modelcache-system", what, "--timeout=300s", timeout=330)


def local_volume(name: str, namespace: str, node: str, root: str, size: str = "1Gi") -> list[dict[str, Any]]:
    """A `local` PersistentVolume at ``root`` on ``node`` and its claim ``namespace/name``, bound
    to each other, as the coordinator makes a node group's serving volumes."""
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{namespace}-{name}"}, "spec": {
        "capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"], "storageClassName": "local-storage",
        "persistentVolumeReclaimPolicy": "Retain", "local": {"path": root},
        "claimRef": {"namespace": namespace, "name": name},
        "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": namespace},
           "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "local-storage",
                    "volumeName": f"{namespace}-{name}", "resources": {"requests": {"storage": size}}}}
    return [pv, pvc]
