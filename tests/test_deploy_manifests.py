"""deploy/: every manifest is accepted by a real API server (tests/cluster), and the workloads and
RBAC keep the contracts the agent and coordinator rely on (least privilege, downward API, probes, ports)."""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.deploy_util import DEPLOY, Obj, find, render
from tests.fixtures.cluster import Cluster
from tests.helpers import REPO


@pytest.fixture(scope="module")
def rendered(kube_binaries: Path) -> list[Obj]:
    return render()


def test_every_yaml_under_deploy_is_part_of_the_kustomization(rendered: list[Obj]) -> None:
    on_disk = {
        (d["kind"], d["metadata"]["name"])
        for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml" and "components" not in p.parts
        for d in yaml.safe_load_all(p.read_text()) if d
    }
    assert on_disk == {(d["kind"], d["metadata"]["name"]) for d in rendered}


def test_every_object_of_ours_is_labelled_part_of_modelcache(rendered: list[Obj]) -> None:
    # Set in each file, not by a kustomize transformer: the kustomization must stay renderable by
    # kustomize v2 (Debian 12's kubectl 1.20), which has no `labels:` field.
    unlabelled = [f"{d['kind']}/{d['metadata']['name']}" for d in rendered if d["kind"] != "CustomResourceDefinition"
                  and (d["metadata"].get("labels") or {}).get("app.kubernetes.io/part-of") != "modelcache"]
    assert unlabelled == []


def test_server_side_apply_of_deploy_is_accepted_on_an_empty_cluster_and_idempotent(
    rendered: list[Obj], cluster_factory: Callable[..., Cluster]
) -> None:
    cluster = cluster_factory(baseline=False)  # nothing of ours installed: CRDs must come from deploy/
    first = cluster.kubectl("apply", "--server-side", "-k", str(DEPLOY)).stdout.splitlines()
    assert len(first) == len(rendered) and all(line.endswith(" serverside-applied") for line in first), first

    def versions() -> dict[str, str]:
        """Each object's resourceVersion, or for one with a spec its generation with its labels and
        annotations: controllers write the status of Deployments, DaemonSets and budgets (and a
        Deployment's revision annotation) after a creation, seconds later on a busy machine; the
        API server applies a ValidatingAdmissionPolicy's status as a field manager of its own, and
        v1.37 then rewrites the managedFields (only their order and time) on every apply of the
        unchanged policy."""
        items = json.loads(cluster.kubectl("get", "-k", str(DEPLOY), "-o", "json").stdout)["items"]
        out = {}
        for i in items:
            meta = i["metadata"]
            ours = {k: v for k, v in (meta.get("annotations") or {}).items()
                    if not k.startswith("deployment.kubernetes.io/")}  # the revision, the controller's
            out[f"{i['kind']}/{meta['name']}"] = json.dumps(
                [meta["generation"], meta.get("labels"), ours], sort_keys=True
            ) if "generation" in meta else meta["resourceVersion"]
        return out

    # The API server writes each admission policy's status (its type checking) once after creating it.
    from tests.helpers import wait_until

    def type_checked() -> bool:
        items = json.loads(cluster.kubectl("get", "validatingadmissionpolicies", "-o", "json").stdout)["items"]
        return all((p.get("status") or {}).get("observedGeneration") == p["metadata"]["generation"] for p in items)

    wait_until(type_checked, timeout=60, what="admission policies type-checked")
    before = versions()
    assert len(before) == len(rendered)
    cluster.kubectl("apply", "--server-side", "-k", str(DEPLOY))
    assert versions() == before, "a second apply must change nothing"

    # The kinds the CRDs define are served: a LocalModelNode as KServe writes it is accepted, through
    # the official client (which validates the body against its models first).
    api_client = cluster.api_client()
    crds = {c.metadata.name for c in client.ApiextensionsV1Api(api_client).list_custom_resource_definition().items}
    assert {d["metadata"]["name"] for d in rendered if d["kind"] == "CustomResourceDefinition"} <= crds
    client.CustomObjectsApi(api_client).create_cluster_custom_object("serving.kserve.io", "v1alpha1",
                                                                     "localmodelnodes", {
        "apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNode", "metadata": {"name": "n1"},
        "spec": {"localModels": [{"modelName": "m", "sourceModelUri": "s3://b/m"}]},
    })
    ds = client.AppsV1Api(api_client).read_namespaced_daemon_set("modelcache-agent", "modelcache-system")
    assert ds.spec.template.spec.containers[0].volume_mounts[0].mount_path == "/mnt/models"


# --- RBAC -----------------------------------------------------------------------------------


def rules(docs: list[Obj], kind: str, name: str) -> list[tuple[str, str, set[str], tuple[str, ...]]]:
    """(apiGroup, resource, verbs, resourceNames) per resource."""
    out = []
    for rule in find(docs, kind, name)["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.append((group, res, set(rule["verbs"]), tuple(rule.get("resourceNames") or ())))
    return out


def verbs_for(rs: list[tuple[str, str, set[str], tuple[str, ...]]], group: str, resource: str) -> set[str]:
    return set().union(*[v for g, r, v, _ in rs if g == group and r == resource])


def test_no_rule_or_env_var_is_duplicated(rendered: list[Obj]) -> None:
    for doc in rendered:
        grants = [(g, r) for rule in doc.get("rules") or [] for g in rule["apiGroups"] for r in rule["resources"]
                  if not rule.get("resourceNames")]
        assert len(grants) == len(set(grants)), f"{doc['kind']}/{doc['metadata']['name']} repeats a grant"
        if doc["kind"] in ("DaemonSet", "Deployment"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                names = [e["name"] for e in c.get("env") or []]
                assert len(names) == len(set(names)), f"{doc['metadata']['name']}/{c['name']} repeats an env var"


def test_no_wildcards_in_any_rule(rendered: list[Obj]) -> None:
    for doc in rendered:
        for rule in doc.get("rules") or []:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], f"{doc['kind']}/{doc['metadata']['name']} grants * in {field}"


def test_agent_rbac_is_least_privilege(rendered: list[Obj]) -> None:
    cluster = rules(rendered, "ClusterRole", "modelcache-agent")
    assert verbs_for(cluster, "serving.kserve.io", "localmodelnodes") == {"get", "list", "watch"}
    assert verbs_for(cluster, "serving.kserve.io", "localmodelnodes/status") == {"patch"}
    assert verbs_for(cluster, "", "pods") == {"list"}
    assert verbs_for(cluster, "", "persistentvolumeclaims") == verbs_for(cluster, "", "persistentvolumes") == {"get"}
    assert verbs_for(cluster, "serving.kserve.io", "localmodelnodegroups") == {"list", "watch"}
    assert verbs_for(cluster, "", "secrets") == set()  # never cluster-wide
    assert verbs_for(cluster, "", "nodes") == {"get"}  # its own Node's uid (status.nodeUID), nothing more
    writable = {(g, r) for g, r, v, _ in cluster if v - {"get", "list", "watch"}}
    assert writable == {("serving.kserve.io", "localmodelnodes/status"), ("authentication.k8s.io", "tokenreviews")}
    assert verbs_for(cluster, "authentication.k8s.io", "tokenreviews") == {"create"}  # peers' tokens
    assert not any(g == "events.k8s.io" for doc in rendered for g, *_ in (rules(rendered, doc["kind"],
                   doc["metadata"]["name"]) if doc["kind"] in ("Role", "ClusterRole") else []))
    events = find(rendered, "Role", "modelcache-agent-events")
    assert events["metadata"]["namespace"] == "default"  # where Events of cluster-scoped objects go
    # Credentials: a namespace of their own, so the agent reads no Secret of modelcache-system.
    role = find(rendered, "Role", "modelcache-agent-credentials")
    ds = find(rendered, "DaemonSet", "modelcache-agent")
    env = {e["name"]: e for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert role["metadata"]["namespace"] == env["MODELCACHE_CREDENTIALS_NAMESPACE"]["value"] == "modelcache-credentials"
    ns_rules = rules(rendered, "Role", "modelcache-agent-credentials")
    assert verbs_for(ns_rules, "", "secrets") == {"get"}
    assert verbs_for(ns_rules, "", "serviceaccounts") == {"get"}
    # KServe's download-Job containers: read cluster-wide; their Jobs (and a credentials Secret
    # each, created only) in a namespace of their own, not where our Secrets are.
    assert verbs_for(cluster, "serving.kserve.io", "clusterstoragecontainers") == {"list", "watch"}
    jobs = rules(rendered, "Role", "modelcache-agent-download-jobs")
    assert find(rendered, "Role", "modelcache-agent-download-jobs")["metadata"]["namespace"] == "modelcache-jobs"
    assert verbs_for(jobs, "batch", "jobs") == {"get", "list", "watch", "create", "delete"}
    assert verbs_for(jobs, "", "secrets") == {"create"}


def test_coordinator_rbac_covers_its_reconcilers_and_no_more(rendered: list[Obj]) -> None:
    cluster = rules(rendered, "ClusterRole", "modelcache-coordinator")
    kserve = "serving.kserve.io"
    for res in ("localmodelcaches", "localmodelnamespacecaches"):
        assert verbs_for(cluster, kserve, res) == {"get", "list", "watch", "update"}
        assert verbs_for(cluster, kserve, f"{res}/status") == {"patch"}
        assert "delete" not in verbs_for(cluster, kserve, res)  # users own their caches
    assert verbs_for(cluster, kserve, "localmodelcaches/finalizers") == {"update"}
    assert verbs_for(cluster, kserve, "localmodelnamespacecaches/finalizers") == set()  # they own nothing
    assert verbs_for(cluster, kserve, "localmodelnodes") == {"get", "list", "watch", "create", "update", "delete"}
    assert verbs_for(cluster, kserve, "localmodelnodegroups") == {"get", "list", "watch"}
    assert verbs_for(cluster, kserve, "clusterstoragecontainers") == set()  # never read
    for res in ("inferenceservices", "llminferenceservices"):
        assert verbs_for(cluster, kserve, res) == {"list", "watch", "patch"}
    for res in ("persistentvolumes", "persistentvolumeclaims"):
        assert verbs_for(cluster, "", res) == {"list", "watch", "create", "delete"}
    assert verbs_for(cluster, "", "nodes") == {"list", "watch", "patch"}
    assert verbs_for(cluster, "", "pods") == set()  # the pod webhook gets pods in the AdmissionReview
    assert verbs_for(cluster, "", "secrets") == set()
    assert verbs_for(cluster, "coordination.k8s.io", "leases") == set()  # only in its namespace
    # Webhook configurations and the namespace: only ours, by name.
    named = {(g, r): names for g, r, _v, names in cluster if names}
    assert named == {("admissionregistration.k8s.io", "mutatingwebhookconfigurations"): ("modelcache-pod-mutator",),
                     ("admissionregistration.k8s.io", "validatingwebhookconfigurations"):
                         ("modelcache-cache-validator",),
                     ("", "namespaces"): ("modelcache-system",),
                     ("apiextensions.k8s.io", "customresourcedefinitions"): (
                         "inferenceservices.serving.kserve.io", "llminferenceservices.serving.kserve.io")}
    ns_rules = rules(rendered, "Role", "modelcache-coordinator")
    assert verbs_for(ns_rules, "coordination.k8s.io", "leases") == {"get", "create", "update"}
    # The webhook Secret: readable by name only; create cannot be limited to a name.
    dep = find(rendered, "Deployment", "modelcache-coordinator")
    secret = next(a.split("=", 1)[1] for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]
                  if a.startswith("--webhook-cert-secret="))
    assert {(v, n) for g, r, vs, n in ns_rules if r == "secrets" for v in vs} == {
        ("create", ()), ("get", (secret,)), ("list", (secret,)), ("watch", (secret,)), ("update", (secret,))}


def test_bindings_point_at_existing_roles_and_service_accounts(rendered: list[Obj]) -> None:
    sas = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in rendered if d["kind"] == "ServiceAccount"}
    bindings = [d for d in rendered if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert len(bindings) == 7  # operate's 5, the KServe config map and the download Jobs
    for b in bindings:
        role_kind = b["roleRef"]["kind"]
        role = find(rendered, role_kind, b["roleRef"]["name"])
        if b["kind"] == "RoleBinding":
            assert role_kind == "ClusterRole" or role["metadata"]["namespace"] == b["metadata"]["namespace"]
        for s in b["subjects"]:
            assert (s["namespace"], s["name"]) in sas
    for workload in (find(rendered, "DaemonSet", "modelcache-agent"), find(rendered, "Deployment",
                                                                           "modelcache-coordinator")):
        pod = workload["spec"]["template"]["spec"]
        assert (workload["metadata"]["namespace"], pod["serviceAccountName"]) in sas


# --- workloads ------------------------------------------------------------------------------


def check_container_hardening(pod: Obj, container: Obj) -> None:
    sc = container.get("securityContext") or {}
    assert sc.get("allowPrivilegeEscalation") is False
    assert sc.get("readOnlyRootFilesystem") is True
    assert sc.get("capabilities", {}).get("drop") == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert "runAsUser" not in sc and "runAsNonRoot" not in sc  # the main containers never override
    res = container["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path and get["port"] in ports
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/tmp" in mounts  # a writable scratch dir, since the root file system is read-only


def test_agent_daemonset_contract(rendered: list[Obj]) -> None:
    ds = find(rendered, "DaemonSet", "modelcache-agent")
    pod = ds["spec"]["template"]["spec"]
    assert ds["metadata"]["namespace"] == "modelcache-system"
    assert pod["nodeSelector"] == {"kserve/localmodel": "worker"}
    (agent,) = pod["containers"]
    check_container_hardening(pod, agent)
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "--node=$(NODE_NAME)" in agent["args"] and "--root=/mnt/models" in agent["args"]
    # The host path is named once (the volume): the agent reads it from its own Pod.
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert "MODELCACHE_HOST_PATH" not in env
    rendered_text = yaml.safe_dump_all(rendered)
    host_root = next(v for v in pod["volumes"] if v["name"] == "hostroot")["hostPath"]["path"]
    assert rendered_text.count(f" {host_root}\n") == 1
    assert agent["command"] == ["modelcache-agent"]
    # Runs wherever the nodeSelector says, whatever the taints, and is not preempted there.
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["priorityClassName"] == "system-node-critical"
    volumes = {v["name"]: v for v in pod["volumes"]}
    (root_mount,) = [m for m in agent["volumeMounts"] if m["mountPath"] == "/mnt/models"]
    assert volumes[root_mount["name"]]["hostPath"]["type"] == "DirectoryOrCreate"
    assert not root_mount.get("readOnly")
    # The only root step is the init container that hands the host dir to uid 1000, with CHOWN only.
    (init,) = pod["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    # Peer transfer: a token for the peer audience only, where the agent reads it by default, the
    # peer port, the pod IP to publish, and the ConfigMap with the off switch.
    from agent.config import AgentConfig
    from agent.peering import AUDIENCE

    (token_mount,) = [m for m in agent["volumeMounts"] if m["name"] == "peer-token"]
    (source,) = volumes["peer-token"]["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == AUDIENCE and token_mount["readOnly"]
    defaults = AgentConfig("n")
    assert f"{token_mount['mountPath']}/{source['serviceAccountToken']['path']}" == str(defaults.peer_token_file)
    assert {"name": "peer", "containerPort": defaults.peer_port} in agent["ports"]
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    config = find(rendered, "ConfigMap", "modelcache-agent")
    assert agent["envFrom"] == [{"configMapRef": {"name": "modelcache-agent", "optional": True}}]
    assert config["data"]["MODELCACHE_PEERS"] in ("auto", "on", "off")


def test_coordinator_deployment_service_and_webhooks_line_up(rendered: list[Obj]) -> None:
    dep = find(rendered, "Deployment", "modelcache-coordinator")
    pod = dep["spec"]["template"]["spec"]
    (coord,) = pod["containers"]
    check_container_hardening(pod, coord)
    assert coord["command"] == ["modelcache-coordinator"]
    env = {e["name"]: e for e in coord["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # lease identity
    assert dep["spec"]["replicas"] >= 2  # leader election makes a standby useful
    # Its own certificate: no Secret volume to wait for (the install works without another step).
    assert any(a.startswith("--webhook-cert-secret=") for a in coord["args"])
    assert not any("secret" in v for v in pod["volumes"])
    tmp = next(v for v in pod["volumes"] if v["name"] == "tmp")
    assert tmp["emptyDir"]["medium"] == "Memory"  # the served key never touches the node's disk

    svc = find(rendered, "Service", "modelcache-coordinator-webhook")
    assert svc["spec"]["selector"].items() <= pod_labels(dep).items()
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] in {p["name"] for p in coord["ports"]}

    hooks = []
    for kind, name in (("MutatingWebhookConfiguration", "modelcache-pod-mutator"),
                       ("ValidatingWebhookConfiguration", "modelcache-cache-validator")):
        config = find(rendered, kind, name)
        assert not (config["metadata"].get("annotations") or {})  # no cert-manager: the coordinator sets the CA
        for hook in config["webhooks"]:
            ref = hook["clientConfig"]["service"]
            assert (ref["name"], ref["namespace"], ref["port"]) == (svc["metadata"]["name"], "modelcache-system",
                                                                    svc_port["port"])
            assert hook["admissionReviewVersions"] == ["v1"]
            assert hook["sideEffects"] == ("NoneOnDryRun" if ref["path"] == "/uninstall" else "None")
            rules_ = [(r["resources"], r["operations"]) for r in hook["rules"]]
            conditions = [c["name"] for c in hook.get("matchConditions") or []]
            hooks.append((ref["path"], hook["failurePolicy"], rules_, conditions))
    # Fail closed only where admitting unchecked would let a bad cache in for good (docs/operations.md).
    assert sorted(hooks) == sorted([
        ("/mutate-pods", "Ignore", [(["pods"], ["CREATE"])], []),  # InferenceService pods
        ("/mutate-pods", "Ignore", [(["pods"], ["CREATE"])], []),  # LLMInferenceService pods
        ("/mutate-services", "Ignore", [(["inferenceservices"], ["CREATE", "UPDATE"]),
                                        (["llminferenceservices"], ["CREATE", "UPDATE"])], []),
        ("/validate-localmodelcaches", "Fail", [(["localmodelcaches"], ["CREATE", "UPDATE"])], ["spec-written"]),
        ("/validate-localmodelcaches", "Ignore", [(["localmodelcaches"], ["DELETE"])], []),
        ("/validate-localmodelnamespacecaches", "Fail", [(["localmodelnamespacecaches"], ["CREATE", "UPDATE"])],
         ["spec-written"]),
        ("/validate-localmodelnamespacecaches", "Ignore", [(["localmodelnamespacecaches"], ["DELETE"])], []),
        ("/uninstall", "Ignore", [(["namespaces"], ["DELETE"])], []),
    ])


def test_the_cert_manager_component_swaps_the_certificate_source(tmp_path: Path, kube_binaries: Path) -> None:
    overlay = tmp_path / "my-install"
    overlay.mkdir()
    base = os.path.relpath(DEPLOY, overlay)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [base], "components": [f"{base}/components/cert-manager"]}))
    docs = render(overlay)
    cert = find(docs, "Certificate", "modelcache-webhook-cert")
    dep = find(docs, "Deployment", "modelcache-coordinator")
    pod = dep["spec"]["template"]["spec"]
    (coord,) = pod["containers"]
    # The coordinator serves the mounted pair (no Secret of its own) ...
    (cert_dir,) = [a.split("=", 1)[1] for a in coord["args"] if a.startswith("--webhook-cert-dir=")]
    assert not any(a.startswith("--webhook-cert-secret") for a in coord["args"])
    (mount,) = [m for m in coord["volumeMounts"] if m["mountPath"] == cert_dir]
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
    assert volume["secret"]["secretName"] == cert["spec"]["secretName"]
    # ... named for the Service the webhooks call, and cert-manager injects its CA into both.
    svc = find(docs, "Service", "modelcache-coordinator-webhook")
    assert f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc" in cert["spec"]["dnsNames"]
    for kind, name in (("MutatingWebhookConfiguration", "modelcache-pod-mutator"),
                       ("ValidatingWebhookConfiguration", "modelcache-cache-validator")):
        annotations = find(docs, kind, name)["metadata"]["annotations"]
        assert annotations["cert-manager.io/inject-ca-from"] == f"modelcache-system/{cert['metadata']['name']}"


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


# --- image ----------------------------------------------------------------------------------


def test_one_image_runs_every_role(rendered: list[Obj]) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    images = set()
    for doc in rendered:
        if doc["kind"] in ("DaemonSet", "Deployment"):
            pod = doc["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                images.add(c["image"])
                if c.get("command", ["python"])[0] != "python":
                    assert c["command"][0] in scripts, f"{c['command'][0]} is not a console script of the package"
    assert len(images) == 1
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=docker.io/library/python:3.11-slim" in dockerfile
    assert "USER 1000:1000" in dockerfile
    assert 'ENTRYPOINT ["storage-initializer"]' in dockerfile and "storage-initializer" in scripts
    for package in ("modelcache", "initializer", "agent", "coordinator"):
        assert f"COPY {package} ./{package}" in dockerfile


def test_kserve_config_is_readable_by_name_only(rendered: list[Obj]) -> None:
    """KServe's inferenceservice-config (credentials defaults, localModel.enabled): get, by name."""
    assert rules(rendered, "ClusterRole", "modelcache-kserve-config") == [
        ("", "configmaps", {"get"}, ("inferenceservice-config",))]


# --- NetworkPolicies ----------------------------------------------------------------------------


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what ours use
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def test_network_policies_select_our_pods_and_name_their_ports(rendered: list[Obj], cluster: Cluster) -> None:
    """deploy/network/: each policy selects the pods it is written for and names ports those pods
    declare (no plugin enforces NetworkPolicies here; the API server validates them, and what they
    select is checked against the pod templates)."""
    workloads = {d["metadata"]["name"]: d for d in rendered if d["kind"] in ("DaemonSet", "Deployment")}
    policies = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "NetworkPolicy"}
    assert set(policies) == {"modelcache-agent", "modelcache-coordinator", "modelcache-download-jobs"}
    for name in ("modelcache-agent", "modelcache-coordinator"):
        policy, template = policies[name]["spec"], workloads[name]["spec"]["template"]
        assert policies[name]["metadata"]["namespace"] == workloads[name]["metadata"]["namespace"]
        assert _selects(policy["podSelector"], template["metadata"]["labels"])
        assert not _selects(policy["podSelector"], workloads[({*workloads} - {name}).pop()]["spec"]["template"]
                            ["metadata"]["labels"])
        assert policy["policyTypes"] == ["Ingress"]  # egress (origins, the API server, peers) stays open
        declared = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports") or []}
        allowed = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
        assert allowed == set(declared), (name, allowed, declared)  # every port it serves, by name, no other
    # The peer port only from agents; health/metrics and webhooks from anywhere (the API server and
    # the kubelet are not pods).
    (peer,) = [r for r in policies["modelcache-agent"]["spec"]["ingress"] if r["ports"][0]["port"] == "peer"]
    assert [_selects(f["podSelector"], workloads["modelcache-agent"]["spec"]["template"]["metadata"]["labels"])
            for f in peer["from"]] == [True]
    jobs = policies["modelcache-download-jobs"]
    assert jobs["metadata"]["namespace"] == "modelcache-jobs" and jobs["spec"] == {"podSelector": {},
                                                                                   "policyTypes": ["Ingress"]}
    # The API server takes them as written.
    out = cluster.kubectl("apply", "--dry-run=server", "-f", str(DEPLOY / "network" / "policies.yaml"))
    assert out.stdout.count("(server dry run)") == 3, out.stdout


def test_every_admission_policy_type_checks_clean(cluster: Cluster) -> None:
    """deploy/policies/ (in the test baseline): the API server type-checks each CEL expression against
    the schemas of the kinds it matches and its parameter kind; a warning there would mean an
    expression that errs (and, failing closed, denies) at admission time."""
    from tests.helpers import wait_until

    def policies() -> list[Obj]:
        out = cluster.kubectl("get", "validatingadmissionpolicies", "-l", "app.kubernetes.io/part-of=modelcache",
                              "-o", "json").stdout
        return list(json.loads(out)["items"])

    def checked() -> bool:
        return all((p.get("status") or {}).get("observedGeneration") == p["metadata"]["generation"]
                   for p in policies())

    wait_until(checked, timeout=60, what="the API server's type checking of our policies")
    names = {p["metadata"]["name"] for p in policies()}
    assert {"modelcache-agent-download-jobs", "modelcache-agent-download-job-root", "modelcache-agent-job-secrets",
            "modelcache-serving-volumes",
            "modelcache-coordinator-webhooks", "modelcache-coordinator-nodes", "modelcache-coordinator-volumes",
            "modelcache-coordinator-events", "modelcache-coordinator-secrets", "modelcache-coordinator-leases",
            "modelcache-coordinator-caches", "modelcache-coordinator-serving-pvs"} <= names, names
    warnings = {p["metadata"]["name"]: [w for w in p["status"]["typeChecking"]["expressionWarnings"]
                                        # v1.37's checker types core `events` as events.k8s.io/v1 (no
                                        # involvedObject there), matchPolicy Exact notwithstanding: the
                                        # expression itself is run by tests/test_security_coordinator.py.
                                        if not w["warning"].startswith("events.k8s.io/v1, Kind=Event: ")]
                for p in policies() if ((p.get("status") or {}).get("typeChecking") or {}).get("expressionWarnings")}
    warnings = {k: v for k, v in warnings.items() if v}
    assert warnings == {}, json.dumps(warnings, indent=1)
