"""`make demo`, cluster part: modelcache's main job on a real (local) Kubernetes control plane.

1. Start the control plane (built from Go modules on the first run) with three Nodes.
2. `kubectl apply -k deploy/` as shipped; the webhooks are pointed at the coordinator's port (no
   kube-proxy here: see tests/cluster/webhooks.py).
3. Start the coordinator and one agent per node as processes, each with its ServiceAccount's token
   and deploy/'s RBAC, each agent with a root folder of its own standing in for its node's disk.
4. Create S3 credentials as KServe takes them (a Secret with the S3 endpoint annotation, a
   ServiceAccount), a LocalModelNodeGroup (node-1, node-2) and a LocalModelCache of one multi-file
   model (safetensors shards and json) in a local S3 server (moto), and print
   `kubectl get localmodelcaches,localmodelnodes` as the copies arrive.
5. Create the InferenceService's predictor pod as KServe would: it is placed by the coordinator's
   webhook and bound by the real scheduler to a node that holds the model.
6. Stop everything.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from modelcache.demo import make_model
from tests.cluster.controlplane import ControlPlane, Proc, free_port
from tests.cluster.webhooks import register_webhooks

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


def wait(what: str, check: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: {what} did not happen within {timeout:.0f} s (logs in {WORK})")
        time.sleep(0.5)


def model_in_s3(folder: Path) -> tuple[Any, str, int]:
    """The sample model (safetensors shards + json) uploaded to a local S3 server (moto)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request

    os.environ.setdefault("MODELCACHE_DEMO_SHARD_MB", "64")
    src = folder / "llm"
    names = make_model(src)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                      aws_access_key_id=S3_KEY[0], aws_secret_access_key=S3_KEY[1])
    s3.create_bucket(Bucket="models")
    size = 0
    for name in names:
        with open(src / name, "rb") as body:
            s3.put_object(Bucket="models", Key=f"llm/{name}", Body=body)
        size += (src / name).stat().st_size
    print(f"a model of {len(names)} files ({size >> 20} MiB: safetensors shards + json) in s3://models/llm "
          f"on a local S3 server (moto) at 127.0.0.1:{port}")
    return server, f"127.0.0.1:{port}", size


def start_process(name: str, args: list[str], env: dict[str, str]) -> Proc:
    proc = Proc(name, [sys.executable, *args], WORK / f"{name}.log")
    proc.log_path.unlink(missing_ok=True)
    with open(proc.log_path, "ab") as log:
        proc.popen = subprocess.Popen(proc.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return proc


def main() -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    say("a real control plane: etcd, kube-apiserver, controller-manager, scheduler (Kubernetes from Go modules)")
    started = time.monotonic()
    shutil.rmtree(WORK / "cp", ignore_errors=True)  # the previous run's etcd data and certificates
    cp = ControlPlane(WORK / "cp")
    processes: list[Proc] = []
    server = None
    try:
        cp.start()
        for i in (1, 2, 3):
            cp.register_node(f"node-{i}", {GROUP_LABEL[0]: GROUP_LABEL[1]} if i < 3 else None)
        print(f"ready in {time.monotonic() - started:.1f} s; kubeconfig: {cp.kubeconfig}")
        kubectl_shown(cp, "version")
        kubectl_shown(cp, "get", "nodes", "-L", GROUP_LABEL[0])

        say("install: kubectl apply --server-side -k deploy/")
        cp.kubectl("apply", "--server-side", "-k", str(REPO / "deploy"))
        # KServe itself is not installed here: its InferenceService CRD stands in (a minimal schema).
        cp.kubectl("apply", "--server-side", "-f", str(REPO / "tests" / "cluster" / "crds"))
        cp.kubectl("wait", "--for", "condition=Established", "crd", "--all", "--timeout", "60s")
        print("applied: CRDs, namespace, RBAC, webhooks, DaemonSet and Deployment (no kubelet runs their pods "
              "here: the coordinator and the agents run as processes below, with the same ServiceAccounts)")

        say("the coordinator and one agent per node, each with its ServiceAccount token")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "AWS_"))}
        hook_port, cert_dir = free_port(), WORK / "webhook-certs"
        coordinator_kc = cp.kubeconfig_for(SA_NAMESPACE, "modelcache-coordinator")
        processes.append(start_process("coordinator", [
            "-m", "coordinator", "--kubeconfig", str(coordinator_kc), "--bind", "127.0.0.1", "--port", "0",
            "--webhook-port", str(hook_port), "--webhook-cert-dir", str(cert_dir), "--self-signed",
            "--pod-rewrite", "on", "--identity", "coordinator-0"], env))
        wait("the coordinator's certificate", lambda: (cert_dir / "tls.crt").exists(), 60)
        register_webhooks(cp, hook_port, cert_dir / "tls.crt")
        agent_kc = cp.kubeconfig_for(SA_NAMESPACE, "modelcache-agent")
        for i in (1, 2, 3):
            processes.append(start_process(f"agent-node-{i}", [
                "-m", "agent", "--node", f"node-{i}", "--root", str(WORK / "nodes" / f"node-{i}"),
                "--kubeconfig", str(agent_kc), "--credentials-namespace", CREDENTIALS_NAMESPACE, "--port", "-1",
                "--status-interval", "1", "--space-margin", "64Mi"], env))
        print(f"coordinator and 3 agents running; logs in {WORK}")

        server, endpoint, size = model_in_s3(WORK)
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
                         "local": {"path": "/mnt/models"}, "persistentVolumeReclaimPolicy": "Delete",
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

        say("kubectl get localmodelcaches,localmodelnodes  (as the copies arrive)")
        last = ""

        def shown_until_available() -> bool:
            nonlocal last
            now = cp.kubectl("get", "localmodelcaches,localmodelnodes").stdout
            if now != last:
                print(f"[{time.strftime('%H:%M:%S')}]\n{now}", flush=True)
                last = now
            copies = yaml.safe_load(cp.kubectl("get", "localmodelcache", "llm", "-o", "yaml").stdout)
            return bool(((copies.get("status") or {}).get("copies") or {}).get("available") == 2)

        wait("two copies available", shown_until_available, 300)

        say("a predictor pod of an InferenceService that uses the cache, created as KServe creates it")
        kubectl_shown(cp, "create", "namespace", "demo")
        isvc = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
                "metadata": {"name": "llm", "namespace": "demo"},
                "spec": {"predictor": {"model": {"modelFormat": {"name": "huggingface"}, "storageUri": uri}}}}
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(isvc))
        wait("the default ServiceAccount of the namespace",
             lambda: cp.kubectl("get", "sa", "default", "-n", "demo", check=False).returncode == 0, 60)
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "llm-predictor-0", "namespace": "demo",
            "labels": {"serving.kserve.io/inferenceservice": "llm", "internal.serving.kserve.io/localmodel": "llm"},
            "annotations": {"internal.serving.kserve.io/storage-initializer-sourceuri": uri}},
            "spec": {"containers": [{"name": "kserve-container", "image": "kserve/huggingfaceserver",
                                     "env": [{"name": "STORAGE_URI", "value": uri}]}]}}
        kubectl_shown(cp, "create", "-f", "-", input=yaml.safe_dump(pod))
        wait("the pod bound to a node", lambda: cp.kubectl(
            "get", "pod", "llm-predictor-0", "-n", "demo", "-o", "jsonpath={.spec.nodeName}").stdout != "", 120)
        kubectl_shown(cp, "get", "pod", "llm-predictor-0", "-n", "demo", "-o", "wide")
        node = cp.kubectl("get", "pod", "llm-predictor-0", "-n", "demo", "-o", "jsonpath={.spec.nodeName}").stdout
        kubectl_shown(cp, "get", "pod", "llm-predictor-0", "-n", "demo", "-o",
                      "jsonpath={.spec.affinity.nodeAffinity}{'\\n'}")
        print(f"bound to {node}, whose agent reports the model Downloaded "
              f"(files under {WORK / 'nodes' / node / 'models'}); node-3 is outside the group and has no copy")
        return 0
    finally:
        say("stopping the agents, the coordinator and the control plane")
        for proc in reversed(processes):
            proc.stop()
        if server is not None:
            server.stop()
        cp.stop()
        print("stopped")


if __name__ == "__main__":
    sys.exit(main())
