"""KServe predictor pods on real nodes (issue 24, items 3, 4 and 5): our init container, the cache path, peers.

KServe v0.20.0's controller manager (tests/kserve, as a process with its own RBAC and webhooks)
is configured, as a user switching to us would, with our image as its storage initializer. An
InferenceService of a model in an S3 server of the tests (moto, which pods reach at the
host's link address) gives KServe's Deployment, whose pod KServe's pod mutator gives our init
container with KServe's arguments and S3 environment; the kubelet runs it, then the serving
container (our serving image: reads every file, checks the safetensors headers, logs each file's
sha256) becomes Ready. The digests it logs are the origin's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modelcache.sources.uri import storage_key
from tests.fixtures.image import Image
from tests.fixtures.realnodes import NodeCluster
from tests.helpers import unique
from tests.kserve import controller as kserve
from tests.realnodes_util import (
    inference_service,
    install,
    model_cache,
    node_group,
    origin_for_pods,
    s3_credentials,
    served_files,
    serving_runtime,
    sha256_files,
    wait_downloaded,
)

pytestmark = [pytest.mark.xdist_group("realnodes"), pytest.mark.timeout(900)]
NS = "team"


def test_our_initializer_fills_a_kserve_predictor_pod(real_nodes: NodeCluster, image: Image, tmp_path: Path) -> None:
    kserve.require_binary()
    kserve.install(real_nodes, storage_initializer=image.ref)
    kserve.apply(real_nodes, [serving_runtime()])
    manager = kserve.start(real_nodes, tmp_path / "kserve")
    try:
        with origin_for_pods(real_nodes) as origin:
            bucket = unique("models")  # moto's servers in one process share their buckets
            uri = f"s3://{bucket}/llm"
            digests = origin.put_model(bucket, "llm", shards=3, shard_bytes=4 << 20)
            listing = origin.client().list_objects_v2(Bucket=bucket, Prefix="llm/")["Contents"]
            size = sum(o["Size"] for o in listing)
            real_nodes.kubectl("create", "namespace", NS)
            account = s3_credentials(real_nodes, NS, origin)
            real_nodes.apply(inference_service("llm", NS, uri, account))
            try:
                real_nodes.kubectl("wait", "--for=create", "deployment/llm-predictor", "-n", NS, "--timeout=120s",
                                   timeout=150)
                real_nodes.kubectl("rollout", "status", "deployment/llm-predictor", "-n", NS, "--timeout=300s",
                                   timeout=330)
            except AssertionError as exc:
                pods = real_nodes.kubectl("get", "pods", "-n", NS, "-o", "yaml", check=False).stdout
                raise AssertionError(f"{exc}\npods:\n{pods[-6000:]}\nKServe:\n{manager.log()[-3000:]}") from None
            (pod,) = predictor_pods(real_nodes)
            name = pod["metadata"]["name"]
            (init,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "storage-initializer"]
            assert init["image"] == image.ref and init["args"] == [uri, "/mnt/models"]
            (state,) = [s for s in pod["status"]["initContainerStatuses"] if s["name"] == "storage-initializer"]
            assert state["state"]["terminated"]["exitCode"] == 0
            init_log = real_nodes.kubectl("logs", "-n", NS, name, "-c", "storage-initializer").stdout
            assert "done: 1/1 pairs ok, 4 files" in init_log, init_log
            log = real_nodes.kubectl("logs", "-n", NS, name, "-c", "kserve-container").stdout
            assert served_files(log) == digests, log
            assert f"loaded model llm from /mnt/models: 4 files, {size} bytes" in log, log
            assert origin.relay.bytes_from_origin >= size
    finally:
        manager.stop()


def predictor_pods(cluster: NodeCluster) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", NS, "-l", "serving.kserve.io/inferenceservice=llm", "-o", "json")
    return list(json.loads(out.stdout)["items"])


def test_the_cache_path_on_real_pods(real_nodes: NodeCluster, image: Image, tmp_path: Path) -> None:
    """Items 4 and 5: the agent pods fill both nodes' /models through deploy/'s hostPath, reading
    the origin about once between them (peers over the pod network, the projected token); then an
    InferenceService of the cached model gets KServe's rewrite and our placement, and its pod mounts
    the cache's PVC and becomes Ready without one byte from the origin."""
    kserve.require_binary()
    install(real_nodes, image.ref, tmp_path / "overlay")
    kserve.install(real_nodes, storage_initializer=image.ref)
    kserve.apply(real_nodes, [serving_runtime()])
    manager = kserve.start(real_nodes, tmp_path / "kserve")
    try:
        with origin_for_pods(real_nodes) as origin:
            bucket = unique("models")
            uri = f"s3://{bucket}/llm"
            digests = origin.put_model(bucket, "llm", shards=4, shard_bytes=16 << 20)
            listing = origin.client().list_objects_v2(Bucket=bucket, Prefix="llm/")["Contents"]
            size = sum(o["Size"] for o in listing)
            account = s3_credentials(real_nodes, "modelcache-credentials", origin)
            group = node_group("workers")
            cache = model_cache("llm", uri, ["workers"], account)
            real_nodes.apply(group, cache)
            wait_downloaded(real_nodes, "llm")
            key = storage_key(uri)
            for node in ("node-1", "node-2"):
                folder = real_nodes.node(node).host_path("/models") / "models" / key
                assert sha256_files(folder) == digests
            # Item 5: the origin was read about once for both nodes; the rest came from the peer.
            from_origin = origin.relay.bytes_from_origin
            assert size <= from_origin < 1.5 * size, (from_origin, size)
            peers = [json.loads(real_nodes.kubectl("get", "localmodelnode", n, "-o", "json").stdout)["status"]["peer"]
                     for n in ("node-1", "node-2")]
            assert sum(p["bytesFromPeers"] for p in peers) > 0, peers

            # Item 4: the predictor pod on the cache, zero bytes from the origin while it starts.
            origin.relay.reset()
            real_nodes.kubectl("create", "namespace", NS)
            real_nodes.apply(inference_service("llm", NS, uri, None))
            try:
                real_nodes.kubectl("wait", "--for=create", "deployment/llm-predictor", "-n", NS, "--timeout=120s",
                                   timeout=150)
                real_nodes.kubectl("rollout", "status", "deployment/llm-predictor", "-n", NS, "--timeout=300s",
                                   timeout=330)
            except AssertionError as exc:
                pods = real_nodes.kubectl("get", "pods", "-n", NS, "-o", "yaml", check=False).stdout
                raise AssertionError(f"{exc}\npods:\n{pods[-6000:]}\nKServe:\n{manager.log()[-3000:]}") from None
            (pod,) = predictor_pods(real_nodes)
            assert not [c for c in pod["spec"].get("initContainers") or [] if c["name"] == "storage-initializer"]
            volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
            assert volumes["kserve-pvc-source"]["persistentVolumeClaim"]["claimName"] == "llm-workers"
            assert pod["spec"]["nodeName"] in ("node-1", "node-2")
            log = real_nodes.kubectl("logs", "-n", NS, pod["metadata"]["name"], "-c", "kserve-container").stdout
            assert served_files(log) == digests, log
            assert origin.relay.bytes_from_origin == 0 and origin.relay.connections == 0
    finally:
        manager.stop()

