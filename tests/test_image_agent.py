"""The image as the agent DaemonSet runs it (deploy/agent/daemonset.yaml), against the real control
plane (tests/cluster), with in-cluster configuration as a pod has it: no kubeconfig, the
ServiceAccount's bound token, the cluster CA and the namespace mounted at
/var/run/secrets/kubernetes.io/serviceaccount, KUBERNETES_SERVICE_HOST/PORT set. Its identity is
deploy/rbac/agent.yaml's, enforced by the API server.

The pod is taken from the manifest: the prepare-root init container (root, CHOWN only) on the
node's hostPath, then the agent container with the manifest's command, args and env (fieldRefs
resolved as the kubelet does), host network, read-only root, no capabilities, uid 1000."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests

from modelcache.sources.uri import storage_key
from tests.agent_util import CRED_NS, create_node, entry, model_files, wait_states
from tests.fixtures.cluster import AGENT_SA, Cluster
from tests.fixtures.http import NginxServer
from tests.fixtures.image import Container, Image, Mount
from tests.fixtures.s3 import S3Server
from tests.helpers import free_port, wait_until
from tests.image_pods import (
    SA_PATH,
    expand,
    in_cluster_env,
    manifest_pod,
    resolve_env,
    service_account_volume,
    user_of,
)

# The first test to use `image` also builds it (minutes when the layer cache is cold).
pytestmark = pytest.mark.timeout(900)

NODE = "node-a"
D = "ModelDownloaded"


def daemonset_pod() -> dict[str, Any]:
    return manifest_pod("agent/daemonset.yaml", "DaemonSet")


def prepare_root(image: Image, host_root: Path) -> subprocess.CompletedProcess[str]:
    """The DaemonSet's prepare-root init container on the node's hostPath, as the manifest says."""
    pod = daemonset_pod()
    [init] = pod["initContainers"]
    ctx = init["securityContext"]
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    # podman's --entrypoint takes the program; the rest of `command` goes before `args`.
    return image.run(*init["command"][1:], *init["args"], entrypoint=init["command"][0],
                     user=user_of(ctx, pod["securityContext"]), mounts=[(host_root, "/mnt/models", "rw")],
                     caps=ctx["capabilities"]["add"])


@pytest.mark.parametrize("start", ["fresh", "someone-elses", "prepared-before", "a-link", "a-dangling-link"])
def test_prepare_root_hands_the_host_path_to_the_agent(start: str, image: Image, tmp_path: Path) -> None:
    """A fresh hostPath (root's), one another uid owns 0755 (a deploy review's finding), a
    restart on a root already handed over: root with CHOWN alone must manage all three. And a
    models/ that a writer of the host directory made a symbolic link (security review L4): the
    link is removed, never followed (its target kept its owner), and the init container does not
    fail on a dangling one (the agent would never start on that node)."""
    host_root = tmp_path / "models"
    host_root.mkdir(mode=0o755)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if start == "someone-elses":
        os.chown(host_root, 2000, 2000)
    elif start == "prepared-before":
        (host_root / "models" / "key").mkdir(parents=True)
        for p in (host_root, host_root / "models", host_root / "models" / "key"):
            os.chown(p, 1000, 1000)
    elif start == "a-link":
        (host_root / "models").symlink_to(elsewhere)
    elif start == "a-dangling-link":
        (host_root / "models").symlink_to("/proc/1/root/nowhere")
    r = prepare_root(image, host_root)
    assert r.returncode == 0, r.stderr
    for p in (host_root, host_root / "models"):
        assert (p.stat().st_uid, p.stat().st_gid) == (1000, 1000)
    assert not (host_root / "models").is_symlink()
    assert (elsewhere.stat().st_uid, elsewhere.stat().st_gid) == (os.getuid(), os.getgid())
    if start == "prepared-before":
        assert (host_root / "models" / "key").stat().st_uid == 1000


def run_pod(image: Image, cluster: Cluster, host_root: Path, tmp_path: Path, health_port: int) -> Container:
    pod = daemonset_pod()
    pod_ctx = pod["securityContext"]
    namespace = AGENT_SA[0]
    [agent] = pod["containers"]
    host_path = next(v["hostPath"]["path"] for v in pod["volumes"] if v["name"] == "hostroot")
    mount_path = next(m["mountPath"] for m in agent["volumeMounts"] if m["name"] == "hostroot")
    assert host_path == "/models" and mount_path == "/mnt/models"

    host_root.mkdir(parents=True, exist_ok=True)  # DirectoryOrCreate: root-owned, 0755
    r = prepare_root(image, host_root)
    assert r.returncode == 0, r.stderr
    root_mount: Mount = (host_root, mount_path, "rw")

    # No Pod object exists for this container: the agent does not find its host path (every PV
    # then counts as its root, the safe side); tests/test_agent_hostpath.py covers finding it.
    env = resolve_env(agent, {"spec.nodeName": NODE, "metadata.namespace": namespace,
                              "metadata.name": f"modelcache-agent-{NODE}", "status.podIP": "127.0.0.1"})
    env.update({
        **in_cluster_env(cluster),
        # Host network here: a free port instead of the manifest's 8080, which others may hold.
        "MODELCACHE_AGENT_PORT": str(health_port),
        "MODELCACHE_AGENT_HOST": "127.0.0.1",
        # Test pacing: status written at once (the manifest keeps the 3 s default).
        "MODELCACHE_STATUS_INTERVAL": "0.2", "MODELCACHE_BACKOFF_INITIAL": "0.5",
    })
    sa = service_account_volume(tmp_path / "serviceaccount", cluster, *AGENT_SA, node=NODE)
    return image.start(
        "agent", *(expand(a, env) for a in agent["args"]), entrypoint=agent["command"][0], env=env,
        user=user_of(agent["securityContext"], pod_ctx), mounts=[root_mount, (sa, SA_PATH, "ro")],
    )


def test_agent_role_in_cluster(image: Image, cluster: Cluster, nginx: NginxServer, moto_s3: S3Server,
                               tmp_path: Path) -> None:
    admin = cluster.kube()
    cluster.register_node(NODE, {"kserve/localmodel": "worker"})
    nginx.write("m/model.bin", 3 << 20)
    bucket = moto_s3.new_bucket()
    s3 = moto_s3.client()
    objects = {"llm/config.json": b'{"a": 1}', "llm/weights/model-1.safetensors": b"w" * (2 << 20)}
    for key, body in objects.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    # S3 credentials in the storage-config Secret of the credential namespace (the manifest's
    # MODELCACHE_CREDENTIALS_NAMESPACE): read with the agent's own RBAC.
    s3_cfg = {"type": "s3", "access_key_id": moto_s3.access_key, "secret_access_key": moto_s3.secret_key,
              "endpoint_url": moto_s3.endpoint, "region": "us-east-1"}
    cluster.kubectl("-n", CRED_NS, "create", "secret", "generic", "storage-config",
                    f"--from-literal=localS3={json.dumps(s3_cfg)}")
    http_uri, s3_uri = nginx.url("m/model.bin"), f"s3://{bucket}/llm"
    create_node(admin, NODE, [entry("web", http_uri), entry("llm", s3_uri, storage={"key": "localS3"})])

    host_root = tmp_path / "node" / "models"  # the node's /models
    port = free_port()
    agent = run_pod(image, cluster, host_root, tmp_path, port)
    try:
        try:
            wait_states(admin, NODE, {"web": D, "llm": D}, timeout=120)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\ncontainer log:\n{agent.logs()[-4000:]}") from None
        assert model_files(host_root, storage_key(http_uri)) == {"model.bin": 3 << 20}
        assert model_files(host_root, storage_key(s3_uri)) == {"config.json": 8,
                                                               "weights/model-1.safetensors": 2 << 20}
        files = [p for p in (host_root / "models").rglob("*") if p.is_file()]
        assert {(p.stat().st_uid, p.stat().st_mode & 0o444) for p in files} == {(1000, 0o444)}

        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: requests.get(f"{base}/readyz", timeout=2).status_code == 200, timeout=30,
                   what="readyz")
        assert requests.get(f"{base}/healthz", timeout=5).status_code == 200
        metrics = requests.get(f"{base}/metrics", timeout=5).text
        assert re.search(r'^modelcache_agent_models\{state="ModelDownloaded"\} 2\.0$', metrics, re.M), metrics
        assert re.search(r'^modelcache_agent_downloaded_bytes_total\{scheme="s3"\} \d', metrics, re.M)

        logs = agent.logs()
        assert "Traceback" not in logs and moto_s3.secret_key not in logs
        assert agent.stop() == 0, agent.logs()[-3000:]  # SIGTERM: a clean exit
    finally:
        agent.remove()
