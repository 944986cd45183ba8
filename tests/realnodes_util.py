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
def origin_for_pods(cluster: NodeCluster) -> Iterator[Origin]:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address=cluster.host_ip, port=port, verbose=False)
    server.start()
    relay = CountingRelay(cluster.host_ip, (cluster.host_ip, port))
    try:
        yield Origin(relay, f"http://{cluster.host_ip}:{port}")
    finally:
        relay.close()
        server.stop()


def s3_credentials(cluster: NodeCluster, namespace: str, origin: Origin, name: str = "models-s3") -> str:
    """A Secret and ServiceAccount as KServe takes S3 credentials (endpoint annotations); the
    ServiceAccount's name."""
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": name, "namespace": namespace, "annotations": {
            "serving.kserve.io/s3-endpoint": origin.endpoint, "serving.kserve.io/s3-usehttps": "0",
            "serving.kserve.io/s3-region": "us-east-1"}},
        "stringData": {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}}
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
