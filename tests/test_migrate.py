"""``modelcache migrate`` on the real control plane: a cluster as KServe's local model cache leaves it
(its controller, node agent and webhook, localModel.enabled false, credentials in its job namespace,
KServe's Helm-managed CRDs, node groups on another host path, a nominal storageLimit). The printed
steps are the switch-over in order; running every printed command as it is (bash, the cluster's
kubectl) leaves a cluster where migrate finds nothing blocking."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelcache.kube.client import CONFIG_MAPS, LOCAL_MODEL_NODE_GROUPS, PERSISTENT_VOLUME_CLAIMS, SECRETS
from modelcache.kube.migrate import CRDS, DAEMON_SETS, DEPLOYMENTS, VALIDATING_WEBHOOKS
from tests.agent_util import ensure_namespace
from tests.cluster.build import BIN
from tests.coordinator_util import make_cache, make_group
from tests.fixtures.cluster import Cluster
from tests.helpers import REPO, wait_until
from tests.pull_helpers import cli_cmd

pytestmark = pytest.mark.timeout(240)

JOBS_NS = "kserve-localmodel-jobs"
LOCAL_MODEL = """{
  # jobNamespace specifies the namespace where the download job will be created.
  "enabled": false,
  "jobNamespace": "kserve-localmodel-jobs",
  "fsGroup": 1000,
  "jobTTLSecondsAfterFinished": 3600,
  "reconcilationFrequencyInSecs": 60
}"""


def _pod_template(name: str) -> dict[str, Any]:
    return {"metadata": {"labels": {"app": name}},
            "spec": {"containers": [{"name": "manager", "image": f"kserve/{name}:v0.20.0"}]}}


def _kserve_installed(cluster: Cluster, kube: Any) -> None:
    """What KServe's kustomize and Helm install for the local model cache, and what it leaves."""
    for ns in ("kserve", JOBS_NS):
        ensure_namespace(kube, ns)
    kube.create(DEPLOYMENTS, {"metadata": {"name": "kserve-localmodel-controller-manager"}, "spec": {
        "replicas": 1, "selector": {"matchLabels": {"app": "lmc"}}, "template": _pod_template("lmc")}}, "kserve")
    kube.create(DAEMON_SETS, {"metadata": {"name": "kserve-localmodelnode-agent"}, "spec": {
        "selector": {"matchLabels": {"app": "lmn"}}, "template": {**_pod_template("lmn"), "spec": {
            "nodeSelector": {"kserve/localmodel": "worker"},
            "containers": [{"name": "manager", "image": "kserve/lmn:v0.20.0"}]}}}}, "kserve")
    kube.create(CONFIG_MAPS, {"metadata": {"name": "inferenceservice-config"}, "data": {
        "localModel": LOCAL_MODEL, "credentials": json.dumps({"storageSpecSecretName": "storage-config"})}}, "kserve")
    # Credentials where KServe's Jobs read them.
    kube.create(SECRETS, {"metadata": {"name": "s3creds", "annotations": {
        "serving.kserve.io/s3-endpoint": "minio.example:9000"}},
        "stringData": {"awsAccessKeyID": "AK", "awsSecretAccessKey": "SK"}}, JOBS_NS)
    from modelcache.kube.client import SERVICE_ACCOUNTS

    kube.create(SERVICE_ACCOUNTS, {"metadata": {"name": "models"}, "secrets": [{"name": "s3creds"}]}, JOBS_NS)
    kube.create(SECRETS, {"metadata": {"name": "storage-config"}, "stringData": {"localS3": "{}"}}, JOBS_NS)
    # Helm's node group (its default host path) and two caches, one per kind of credentials.
    make_group(kube, "workers", path="/mnt/models")
    kube.patch(LOCAL_MODEL_NODE_GROUPS, "workers", {"spec": {"storageLimit": "10Gi"}})
    make_cache(kube, "llm", "s3://models/llm", ["workers"], serviceAccountName="models", modelSize="8Gi")
    make_cache(kube, "spec", "s3://models/spec", ["workers"], storage={"key": "localS3"}, modelSize="8Gi")
    # KServe's download PVC, left in its job namespace.
    kube.create(PERSISTENT_VOLUME_CLAIMS, {"metadata": {"name": "llm-workers"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}, JOBS_NS)
    # KServe's CRD for node groups, as its Helm chart installs it: no printer columns.
    crd = kube.get(CRDS, "localmodelnodegroups.serving.kserve.io")
    patch = [{"op": "remove", "path": "/spec/versions/0/additionalPrinterColumns"},
             {"op": "add", "path": "/metadata/labels", "value": {"app.kubernetes.io/managed-by": "Helm"}}]
    assert crd["spec"]["versions"][0].get("additionalPrinterColumns")
    cluster.kubectl("patch", "crd", "localmodelnodegroups.serving.kserve.io", "--type", "json", "-p",
                    json.dumps(patch))
    # KServe's cache webhook, its server gone with the controller (failurePolicy Fail, as shipped).
    kube.create(VALIDATING_WEBHOOKS, {"metadata": {"name": "localmodelcache.serving.kserve.io"}, "webhooks": [{
        "name": "localmodelcache.kserve-webhook-server.validator", "admissionReviewVersions": ["v1"],
        "sideEffects": "None", "failurePolicy": "Fail",
        "clientConfig": {"url": "https://127.0.0.1:1/validate-serving-kserve-io-v1alpha1-localmodelcache"},
        "rules": [{"apiGroups": ["serving.kserve.io"], "apiVersions": ["v1alpha1"],
                   "operations": ["CREATE", "UPDATE"], "resources": ["localmodelcaches"]}]}]})


def _migrate(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli_cmd(), "migrate", "--kubeconfig", str(cluster.kubeconfig), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def _run_commands(cluster: Cluster, output: str) -> None:
    """Every non-comment line, as a user would paste it: bash, kubectl on PATH, in the repository."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PATH": f"{BIN}:{os.environ['PATH']}"}
    for line in output.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        done = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, f"{line}\n{done.stderr}"


def test_migrate_prints_the_switch_over_in_order_and_its_commands_clear_it(cluster: Cluster) -> None:
    kube = cluster.kube()
    _kserve_installed(cluster, kube)

    before = _migrate(cluster, "--no-list")  # (their sources: test_migrate_lists_every_source_... below)
    assert before.returncode == 1, before.stderr
    found = [ln.split("] ", 1)[0].split("[", 1)[1] for ln in before.stdout.splitlines() if ln.startswith("# ") and
             "[" in ln]
    assert found == ["kserve-agent", "kserve-controller", "kserve-webhook", "local-model-enabled", "crds",
                     "crds-helm", "credentials", "credentials", "install", "host-path", "storage-limit"], before.stdout
    out = before.stdout
    assert "kubectl -n kserve delete daemonset kserve-localmodelnode-agent" in out
    assert "kubectl -n kserve scale deployment kserve-localmodel-controller-manager --replicas=0" in out
    assert "the agent's root is host path /models but the node groups' PVs name /mnt/models" in out
    assert "KServe's, not ours: localmodelnodegroups" in out
    assert "SK" not in out and "AK" not in out  # names only, never credentials

    _run_commands(cluster, out)

    after = _migrate(cluster, "--no-list")
    assert after.returncode == 0, after.stdout + after.stderr
    assert "# nothing blocks the switch" in after.stdout
    # What the commands did, checked on the cluster itself.
    local = yaml.safe_load("\n".join(ln for ln in kube.get(CONFIG_MAPS, "inferenceservice-config", "kserve")[
        "data"]["localModel"].splitlines() if not ln.strip().startswith("#")))
    assert local["enabled"] is True and local["jobNamespace"] == JOBS_NS
    assert kube.get_or_none(DAEMON_SETS, "kserve-localmodelnode-agent", "kserve") is None
    assert kube.get(DEPLOYMENTS, "kserve-localmodel-controller-manager", "kserve")["spec"]["replicas"] == 0
    assert kube.get_or_none(VALIDATING_WEBHOOKS, "localmodelcache.serving.kserve.io") is None
    assert kube.get(SECRETS, "s3creds", "modelcache-credentials")["metadata"]["annotations"][
        "serving.kserve.io/s3-endpoint"] == "minio.example:9000"
    assert kube.get_or_none(SECRETS, "storage-config", "modelcache-credentials") is not None
    ds = kube.get(DAEMON_SETS, "modelcache-agent", "modelcache-system")
    assert {"name": "hostroot", "hostPath": {"path": "/mnt/models", "type": "DirectoryOrCreate"}} in \
        ds["spec"]["template"]["spec"]["volumes"]
    assert kube.get(LOCAL_MODEL_NODE_GROUPS, "workers")["spec"]["storageLimit"] == "16Gi"  # 2 x 8Gi
    assert kube.get(CRDS, "localmodelnodegroups.serving.kserve.io")["metadata"]["annotations"][
        "helm.sh/resource-policy"] == "keep"
    # After the switch: KServe's leftovers, optional.
    assert "(optional)" in after.stdout and f"kubectl -n {JOBS_NS} delete pvc llm-workers" in after.stdout
    steps = json.loads(_migrate(cluster, "--json", "--no-list").stdout)
    assert steps["blocking"] == 0 and [s["check"] for s in steps["steps"]] == ["kserve-leftovers"]


def test_migrate_without_a_kubeconfig_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([*cli_cmd(), "migrate", "--kubeconfig", str(tmp_path / "none")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert str(tmp_path / "none") in proc.stderr


def test_migrate_lists_every_source_as_the_agent_will_and_names_identities_and_refused_uris(
    cluster: Cluster, moto_s3: Any, hf_hub: Any, tmp_path: Path
) -> None:
    """Before the switch (M2, M4, M5 of the v0.20 audit): each cache's source is listed from here
    with the credentials the agent will build (its own code, agent/precheck.py; the Secrets still in
    KServe's job namespace), and every one that fails is named with why; keyless caches on a cloud
    whose identity is bound to KServe's download Jobs get the binding steps; a URI modelcache does
    not read is named."""
    from modelcache.kube.client import SERVICE_ACCOUNTS

    kube = cluster.kube()
    for ns in ("kserve", JOBS_NS):
        ensure_namespace(kube, ns)
    bucket = moto_s3.new_bucket()
    moto_s3.client().put_object(Bucket=bucket, Key="llm/model.safetensors", Body=b"w" * 4096)
    hf_hub.create_repo("org/public").commit({"config.json": b"{}", "model.safetensors": b"x" * 2048})
    endpoint = {"serving.kserve.io/s3-endpoint": moto_s3.endpoint}
    kube.create(SECRETS, {"metadata": {"name": "good", "annotations": endpoint},
                          "stringData": {"awsAccessKeyID": moto_s3.access_key,
                                         "awsSecretAccessKey": moto_s3.secret_key}}, JOBS_NS)
    kube.create(SECRETS, {"metadata": {"name": "stale", "annotations": endpoint},
                          "stringData": {"awsAccessKeyID": moto_s3.access_key, "awsSecretAccessKey": "revoked"}},
                JOBS_NS)
    kube.create(SERVICE_ACCOUNTS, {"metadata": {"name": "good"}, "secrets": [{"name": "good"}]}, JOBS_NS)
    kube.create(SERVICE_ACCOUNTS, {"metadata": {"name": "stale"}, "secrets": [{"name": "stale"}]}, JOBS_NS)
    # KServe's download Jobs run as default in its job namespace: IRSA and GKE WI bound there.
    role, gsa = "arn:aws:iam::123456789012:role/models", "models@ml-prod.iam.gserviceaccount.com"
    wait_until(lambda: kube.get_or_none(SERVICE_ACCOUNTS, "default", JOBS_NS) is not None, timeout=30,
               what="the job namespace's default ServiceAccount")
    kube.patch(SERVICE_ACCOUNTS, "default", {"metadata": {"annotations": {
        "eks.amazonaws.com/role-arn": role, "iam.gke.io/gcp-service-account": gsa}}}, JOBS_NS)
    # Our agent's DaemonSet as deploy/ installs it (its plain env is where its downloads start).
    kube.create(DAEMON_SETS, {"metadata": {"name": "modelcache-agent"}, "spec": {
        "selector": {"matchLabels": {"app": "a"}}, "template": {"metadata": {"labels": {"app": "a"}}, "spec": {
            "serviceAccountName": "modelcache-agent",
            "containers": [{"name": "agent", "image": "modelcache", "env": [
                {"name": "HF_ENDPOINT", "value": hf_hub.url}]}]}}}}, "modelcache-system")
    make_group(kube, "workers")
    make_cache(kube, "llm", f"s3://{bucket}/llm", ["workers"], serviceAccountName="good")
    make_cache(kube, "stale", f"s3://{bucket}/llm", ["workers"], serviceAccountName="stale")
    make_cache(kube, "public", "hf://org/public", ["workers"])
    make_cache(kube, "gone", "http://127.0.0.1:9/models/model.bin", ["workers"])
    make_cache(kube, "nosa", f"s3://{bucket}/llm/", ["workers"], serviceAccountName="missing")
    make_cache(kube, "irsa", "s3://Legacy_Bucket/llm", ["workers"])  # keyless: IRSA
    make_cache(kube, "gke", "gs://models/llm", ["workers"])  # keyless: GKE Workload Identity
    make_cache(kube, "dots", "s3://bucket/a/../m", ["workers"])

    proc = _migrate(cluster, "--json")
    doc = json.loads(proc.stdout)
    by_check: dict[str, list[dict[str, Any]]] = {}
    for step in doc["steps"]:
        by_check.setdefault(step["check"], []).append(step)
    sources = {s["finding"].split(":", 1)[0].removeprefix("cache "): s for s in by_check.get("sources", [])}
    assert set(sources) == {"stale", "gone", "nosa"}, by_check.get("sources")
    assert "listing" in sources["stale"]["finding"] and "Unauthorized" in sources["stale"]["finding"]
    assert "not copied yet" in sources["stale"]["finding"]  # read where KServe keeps it
    assert "service account 'missing' not found" in sources["nosa"]["finding"]
    assert all(not s["blocking"] for s in sources.values())
    assert "revoked" not in proc.stdout and moto_s3.secret_key not in proc.stdout
    identity = {s["finding"].split(" is bound", 1)[0]: s for s in by_check["identity"]}
    assert set(identity) == {"AWS IRSA", "GKE Workload Identity"}
    aws, gke = identity["AWS IRSA"], identity["GKE Workload Identity"]
    assert aws["blocking"] and "(irsa)" in aws["finding"]
    assert aws["commands"][0] == ("kubectl -n modelcache-system annotate serviceaccount modelcache-agent "
                                  f"eks.amazonaws.com/role-arn={role} --overwrite")
    assert "system:serviceaccount:modelcache-system:modelcache-agent" in aws["notes"][0]
    assert "ml-prod.svc.id.goog[modelcache-system/modelcache-agent]" in gke["notes"][0] and "(gke)" in gke["finding"]
    (dots,) = by_check["uris"]
    assert "cache dots" in dots["finding"] and "'..' segments" in dots["finding"] and not dots["blocking"]
    # The printed form: notes as comment lines, the annotate command runnable as printed.
    text = _migrate(cluster).stdout
    assert "#    gcloud iam service-accounts add-iam-policy-binding " + gsa in text
    _run_commands(cluster, "\n".join(ln for ln in text.splitlines() if "annotate serviceaccount" in ln))
    annotations = kube.get(SERVICE_ACCOUNTS, "modelcache-agent", "modelcache-system")["metadata"]["annotations"]
    assert annotations["eks.amazonaws.com/role-arn"] == role and annotations["iam.gke.io/gcp-service-account"] == gsa
    assert "identity" not in {s["check"] for s in json.loads(_migrate(cluster, "--json", "--no-list").stdout)[
        "steps"]}


def test_identity_steps_for_each_cloud_and_the_uris_modelcache_does_not_read() -> None:
    """The checks as functions of what migrate read (no cluster): Azure Workload Identity gets the
    annotation, the pod-template label and the federated credential; keyless S3 caches with no IRSA
    annotation on KServe's job identity are named (EKS Pod Identity, instance roles: not visible in
    the cluster); an identity already bound to the agent is no step; a refused URI is a warning."""
    from modelcache.kube import migrate as mig

    f = mig.Facts()
    f.caches = [{"metadata": {"name": "s3"}, "spec": {"sourceModelUri": "s3://Legacy_Bucket/llm"}},
                {"metadata": {"name": "az", "namespace": "team"},
                 "spec": {"sourceModelUri": "https://acct.privatelink.blob.core.windows.net/c/m"}},
                {"metadata": {"name": "sas"},  # its own credential: no identity needed
                 "spec": {"sourceModelUri": "https://acct.blob.core.windows.net/c/m?sv=2024&sig=abc"}},
                {"metadata": {"name": "keyed"},  # names its credentials
                 "spec": {"sourceModelUri": "https://acct.blob.core.windows.net/c/k", "serviceAccountName": "x"}},
                {"metadata": {"name": "dots"}, "spec": {"sourceModelUri": "s3://b/a/../m"}}]
    f.job_identity = {"metadata": {"annotations": {"azure.workload.identity/client-id": "cid"}}}
    steps = mig.plan(f)
    identity = [s for s in steps if s.check == "identity"]
    azure = next(s for s in identity if s.finding.startswith("Azure Workload Identity"))
    assert "(team/az)" in azure.finding and azure.blocking
    assert azure.commands[0] == ("kubectl -n modelcache-system annotate serviceaccount modelcache-agent "
                                 "azure.workload.identity/client-id=cid --overwrite")
    assert '"azure.workload.identity/use": "true"' in azure.commands[1]
    assert azure.commands[-1] == "kubectl -n modelcache-system rollout restart daemonset modelcache-agent"
    assert "--subject system:serviceaccount:modelcache-system:modelcache-agent" in azure.notes[0]
    aws = next(s for s in identity if s.finding.startswith("keyless S3 caches"))
    assert "(s3)" in aws.finding and not aws.blocking and "create-pod-identity-association" in aws.notes[0]
    (dots,) = [s for s in steps if s.check == "uris"]
    assert "cache dots" in dots.finding and not dots.blocking
    text = mig.render(steps, "h")
    assert "#    az identity federated-credential create" in text and "(a warning: it does not block" in text
    # Bound to the agent already: nothing to do for Azure.
    f.agent_account = {"metadata": {"annotations": {"azure.workload.identity/client-id": "cid"}}}
    assert not [s for s in mig.plan(f) if s.finding.startswith("Azure Workload Identity")]
