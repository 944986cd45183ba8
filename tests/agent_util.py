"""Helpers for the agent tests: run ``modelcache-agent`` as a subprocess against the real API
server (as its ServiceAccount), and create/read the Kubernetes objects it works from."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException

from modelcache.kube.client import (
    LOCAL_MODEL_NODE_GROUPS,
    LOCAL_MODEL_NODES,
    NAMESPACES,
    SECRETS,
    SERVICE_ACCOUNTS,
    Kube,
)
from tests import forked
from tests.cluster.controlplane import on_node
from tests.helpers import REPO, stop_process, wait_until

#: deploy/'s credential namespace: the only one whose Secrets the agent's RBAC lets it read.
CRED_NS = "modelcache-credentials"
#: Short timings so failures, retries and checks happen within a test's few seconds.
FAST_FLAGS = ("--backoff-initial", "0.5", "--backoff-max", "2", "--status-interval", "0.5",
              "--removal-recheck", "0.3", "--resync-period", "5", "--space-margin", "1Mi",
              "--chunk-size", "1Mi", "--workers", "2", "--transfer-attempts", "2")


@dataclass
class AgentProc:
    node: str
    root: Path
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def port(self) -> int:
        found: list[int] = []

        def ready() -> bool:
            m = re.search(r'msg="serving health and metrics" host=\S+ port=(\d+)', self.log())
            if m:
                found.append(int(m.group(1)))
            return bool(m)

        wait_until(ready, timeout=20, what="agent health server")
        return found[0]

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)


def start_agent(kubeconfig: Path | None, node: str, root: Path, workdir: Path, *extra: str,
                env: dict[str, str] | None = None, name: str = "", code: Path = REPO) -> AgentProc:
    """``code``: the source tree to run (an earlier release's, for upgrade tests). Its TMPDIR is
    a folder of ``workdir`` unless ``env`` names one: an agent SIGKILLed mid-download (the chaos
    and first-week tests) cannot remove its credential folder, and in the host's /tmp those stayed
    after the suite (four ``modelcache-agent-cred-*`` after stop 41's runs)."""
    workdir.mkdir(parents=True, exist_ok=True)
    stamp = time.monotonic_ns()
    log_path = workdir / f"agent-{name or node}-{stamp}.log"
    cmd = [sys.executable, "-m", "agent", "--node", node, "--root", str(root), "--port", "0",
           "--credentials-namespace", CRED_NS, *FAST_FLAGS, *extra]
    if kubeconfig is not None:
        # A ServiceAccount's kubeconfig: its token bound to a pod on the node, as the DaemonSet's
        # pod has (deploy/policies/node-status.yaml lets only that write the node's status).
        cmd += ["--kubeconfig", str(on_node(kubeconfig, node))]
    penv = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBECONFIG"))}
    penv["TMPDIR"] = str(workdir / f"tmp-{name or node}-{stamp}")
    penv.update(env or {})
    Path(penv["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=code, stdout=out, stderr=subprocess.STDOUT, env=penv)
    return AgentProc(node, root, log_path, proc)


# ---- objects ----------------------------------------------------------------------------


def kube_for(api: Any) -> Kube:
    return Kube(api.api_client())


def ensure_namespace(kube: Kube, name: str) -> None:
    try:
        kube.create(NAMESPACES, {"metadata": {"name": name}})
    except ApiException as exc:
        if exc.status != 409:
            raise


def entry(name: str, uri: str, **extra: Any) -> dict[str, Any]:
    return {"modelName": name, "sourceModelUri": uri, **extra}


def create_node(kube: Kube, node: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
    return kube.create(LOCAL_MODEL_NODES, {"metadata": {"name": node}, "spec": {"localModels": entries}})


def set_entries(kube: Kube, node: str, entries: list[dict[str, Any]]) -> None:
    kube.patch(LOCAL_MODEL_NODES, node, {"spec": {"localModels": entries}})


def node_status(kube: Kube, node: str) -> dict[str, Any]:
    return kube.get(LOCAL_MODEL_NODES, node).get("status") or {}


def wait_states(kube: Kube, node: str, want: dict[str, str], timeout: float = 60,
                agent: AgentProc | None = None) -> dict[str, Any]:
    """Wait until ``status.modelStatus`` has exactly these states for these keys."""
    seen: dict[str, Any] = {}

    def check() -> bool:
        seen.clear()
        seen.update(node_status(kube, node))
        ms = seen.get("modelStatus") or {}
        return all(ms.get(k) == v for k, v in want.items())

    try:
        wait_until(check, timeout=timeout, what=f"states {want}")
    except TimeoutError as exc:
        tail = agent.log()[-4000:] if agent else ""
        raise AssertionError(f"{exc}; status now: {seen}\nagent log tail:\n{tail}") from None
    return seen


def create_group(kube: Kube, name: str, storage_limit: str, path: str) -> None:
    kube.create(LOCAL_MODEL_NODE_GROUPS, {
        "metadata": {"name": name},
        "spec": {
            "storageLimit": storage_limit,
            "persistentVolumeSpec": {
                "accessModes": ["ReadWriteOnce"], "capacity": {"storage": storage_limit},
                "local": {"path": path}, "storageClassName": "standard",
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-a"]}]}]}},
            },
            "persistentVolumeClaimSpec": {"accessModes": ["ReadWriteOnce"],
                                          "resources": {"requests": {"storage": storage_limit}}},
        },
    })


def create_secret(kube: Kube, name: str, string_data: dict[str, str],
                  annotations: dict[str, str] | None = None) -> None:
    meta: dict[str, Any] = {"name": name}
    if annotations:
        meta["annotations"] = annotations
    kube.create(SECRETS, {"metadata": meta, "stringData": string_data}, CRED_NS)


def create_service_account(kube: Kube, name: str, secrets: list[str]) -> None:
    kube.create(SERVICE_ACCOUNTS, {"metadata": {"name": name}, "secrets": [{"name": s} for s in secrets]}, CRED_NS)


def model_files(root: Path, key: str) -> dict[str, int]:
    base = root / "models" / key
    return {str(p.relative_to(base)): p.stat().st_size for p in sorted(base.rglob("*")) if p.is_file()}


def poll_while(cond: Callable[[], bool], check: Callable[[], None], timeout: float) -> None:
    """Run ``check`` repeatedly until ``cond`` holds (for invariants that must hold throughout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check()
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


# -- standalone mode: a LocalModelNode file in, FILE.status.yaml out ------------------------------


def write_node(path: Path, entries: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNode",
                                    "metadata": {"name": "box"}, "spec": {"localModels": entries}}))
    return path


def agent_args(spec: Path, root: Path, *extra: str) -> list[str]:
    return ["--standalone", str(spec), "--root", str(root), "--port", "-1", *FAST_FLAGS, *extra]


def agent_cmd(spec: Path, root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "agent", *agent_args(spec, root, *extra)]


def run_agent(spec: Path, root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The standalone agent run to its end, forked with the product imported (tests/forked.py)."""
    return forked.run_module("agent", *agent_args(spec, root, *extra), cwd=REPO, timeout=60)


def status_of(spec: Path) -> dict[str, Any]:
    return yaml.safe_load(spec.with_name(spec.name + ".status.yaml").read_text())["status"]


# ---- the agent as its DaemonSet pod is ------------------------------------------------------


def apply_agent_daemonset(cluster: Any, host_path: str) -> None:
    """deploy/'s agent DaemonSet with its hostroot volume at ``host_path``: the DaemonSet controller
    makes a pod for each model node and the scheduler binds it (nothing runs it here). The download
    Job policy (deploy/policies/agent-jobs.yaml) reads the host directory from it."""
    import copy

    from tests.deploy_util import find, render

    ds = copy.deepcopy(find(render(), "DaemonSet", "modelcache-agent"))
    for v in ds["spec"]["template"]["spec"]["volumes"]:
        if v["name"] == "hostroot":
            v["hostPath"]["path"] = host_path
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(ds))
