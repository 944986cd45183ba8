"""Real nodes in tests/cluster (issue 24, item 1): `python -m tests.cluster up DIR --nodes N --kubelet K`
runs pods on kubelets of this machine, and leaves the machine as it found it, even when killed.

Each test starts its own run (a control plane, kubelets, containerds) as a user would, in a
process, and compares the host before and after: links, routes, mounts, cgroups, iptables and
nftables rules, ip_forward, the kubelet's fixed paths.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.cluster import cgroups
from tests.cluster.build import CONTROL_PLANE, NODE_RUNTIME
from tests.cluster.images import static_image
from tests.cluster.slot import STATE, Names, Slot
from tests.helpers import wait_until
from tests.node_util import Up, host_state, kubectl, safetensors

pytestmark = pytest.mark.xdist_group("realnodes")


@pytest.fixture(autouse=True)
def _needs(real_node_builds: None) -> None:
    pass


def serving_pod(name: str, node: str, model_dir: Path, model: str = "m") -> dict[str, object]:
    """Our serving image reading a model from a host folder, with its readiness probe."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": {
        "nodeName": node, "terminationGracePeriodSeconds": 5,
        "containers": [{"name": "serve", "image": static_image("serve").ref, "imagePullPolicy": "Never",
                        "args": [f"--model-name={model}", "--model-dir=/mnt/models"],
                        "readinessProbe": {"httpGet": {"path": f"/v1/models/{model}", "port": 8080},
                                           "periodSeconds": 1},
                        "resources": {"limits": {"memory": "64Mi"}, "requests": {"cpu": "10m", "memory": "16Mi"}},
                        "volumeMounts": [{"name": "model", "mountPath": "/mnt/models", "readOnly": True}]}],
        "volumes": [{"name": "model", "hostPath": {"path": str(model_dir), "type": "Directory"}}]}}


def get(kubeconfig: Path, *what: str) -> dict[str, object]:
    return dict(json.loads(kubectl(kubeconfig, "get", *what, "-o", "json").stdout))


def pod_ready(kubeconfig: Path, name: str) -> bool:
    pod = get(kubeconfig, "pod", name)
    conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}  # type: ignore[attr-defined]
    return conditions.get("Ready") == "True"


def test_up_with_a_kubelet_runs_pods_and_leaves_the_host_as_it_was(tmp_path: Path) -> None:
    before = host_state((tmp_path,))
    model = tmp_path / "model"
    model.mkdir()
    data = safetensors({"w": ("F32", [64, 64]), "b": ("F32", [64])})
    (model / "model.safetensors").write_bytes(data)
    up = Up(tmp_path / "run", "--nodes", "2", "--kubelet", "1")
    try:
        up.wait_ready()
        kc = up.kubeconfig
        nodes = {n["metadata"]["name"]: n for n in get(kc, "nodes")["items"]}  # type: ignore[attr-defined]
        assert sorted(nodes) == ["node-1", "node-2"]
        real = nodes["node-1"]["status"]
        assert real["nodeInfo"]["kubeletVersion"] == CONTROL_PLANE.pinned_version("k8s.io/kubernetes")
        assert real["nodeInfo"]["containerRuntimeVersion"] == "containerd://" + NODE_RUNTIME.pinned_version(
            "github.com/containerd/containerd/v2").lstrip("v")
        assert int(real["capacity"]["cpu"]) == os.cpu_count()  # the machine's own, reported by the kubelet
        internal = [a["address"] for a in real["addresses"] if a["type"] == "InternalIP"]
        slot = Names(next(n for n in range(8) if internal == [Names(n).node_ip]))
        assert not nodes["node-1"]["spec"].get("taints"), "the node lifecycle controller lifts not-ready"
        api_only = nodes["node-2"]["status"]
        assert api_only["nodeInfo"]["kubeletVersion"] == "" and {
            c["type"]: c["status"] for c in api_only["conditions"]}["Ready"] == "True"

        kubectl(kc, "apply", "-f", "-", input=yaml.safe_dump(serving_pod("serve", "node-1", model)))
        wait_until(lambda: pod_ready(kc, "serve"), timeout=120, what="the serving pod Ready")
        pod = get(kc, "pod", "serve")
        ip = pod["status"]["podIP"]  # type: ignore[index]
        assert ip in [str(h) for h in slot.pod_cidr(1).hosts()], ip
        logs = kubectl(kc, "logs", "serve").stdout  # through the API server and the kubelet's API
        assert f"file model.safetensors {len(data)} bytes sha256:{hashlib.sha256(data).hexdigest()}" in logs
        with urllib.request.urlopen(f"http://{ip}:8080/v1/models/m", timeout=10) as resp:  # host -> pod
            assert json.loads(resp.read()) == {"name": "m", "ready": True}
        # The `kubernetes` Service, through kube-proxy's rules in the nodes' namespace, reaches the
        # API server at the address it published (what in-cluster clients in pods use).
        endpoints = get(kc, "endpoints", "kubernetes")
        assert [a["ip"] for a in endpoints["subsets"][0]["addresses"]] == [slot.host_ip]  # type: ignore[index]
        probe = subprocess.run(["nsenter", f"--net={slot.netns}", "curl", "-sk", "--max-time", "10",
                                "https://10.96.0.1/readyz"], capture_output=True, text=True)
        assert probe.stdout == "ok", probe
        # A graceful deletion completes: the kubelet stops the container and confirms.
        started = time.monotonic()
        kubectl(kc, "delete", "pod", "serve", "--wait=true", "--timeout=60s")
        assert time.monotonic() - started < 60
        assert "modelcache-test" in slot.cgroup and cgroups.pids(slot.cgroup)
    finally:
        code = up.stop()
    assert code == 0, up.stderr()
    after = host_state((tmp_path,))
    assert before.differences(after, slot.n) == []


def test_a_killed_run_is_swept_by_the_next_one(tmp_path: Path) -> None:
    """SIGKILL leaves what a node keeps running on purpose (containerd's shims and the pods'
    containers outlive containerd) and what the dead process did not undo (mounts, the network
    namespace, cgroups); the next run in that slot removes it all before it starts."""
    before = host_state((tmp_path,))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(safetensors({"w": ("F32", [8])}))
    first = Up(tmp_path / "first", "--nodes", "1", "--kubelet", "1")
    try:
        first.wait_ready()
        kc = first.kubeconfig
        kubectl(kc, "apply", "-f", "-", input=yaml.safe_dump(serving_pod("serve", "node-1", model)))
        wait_until(lambda: pod_ready(kc, "serve"), timeout=120, what="the serving pod Ready")
        slot = next(Names(n) for n in range(8) if (Names(n).run_dir / "record.json").exists()
                    and str(tmp_path / "first") in (Names(n).run_dir / "record.json").read_text())
    except BaseException:
        first.stop()
        raise
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    time.sleep(2)  # PR_SET_PDEATHSIG ends the kubelet and containerd
    left = cgroups.pids(slot.cgroup)
    assert left, "the shim and the serving container outlive containerd"
    # The namespaces' pins (the nodes' mounts live in their mount namespaces, held by the pins).
    assert slot.netns.exists() and (slot.run_dir / "node-1" / "mntns") in {
        Path(m) for m in host_state((tmp_path,)).mounts}
    assert (STATE / f"slot-{slot.n}.lock").exists()

    # The next owner of the slot (here this test; any run that takes the slot does the same).
    taken = Slot.claim([], only=slot.n, wait=60)
    try:
        assert any(found.endswith("processes") for found in taken.swept), taken.swept
        assert any(found.endswith("mounts") for found in taken.swept), taken.swept
        wait_until(lambda: not any(_alive(pid) for pid in left), timeout=10, what="the left processes gone")
    finally:
        taken.release()
    assert before.differences(host_state((tmp_path,)), slot.n) == []


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
