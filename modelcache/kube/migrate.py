"""``modelcache migrate``: what stands between a cluster and modelcache replacing KServe's local model
cache, and the commands that clear it, in the order of the switch-over (deploy/README.md).

One read of the cluster (:class:`Facts`), then checks that are plain functions of it, each giving
:class:`Step` s: a one-line finding and the commands that fix it. Run before switching (KServe's
controller, agent and webhook still there, ``localModel.enabled``, credentials only in KServe's job
namespace, CRDs that are KServe's), and after (host paths, limits, what KServe left behind): when
nothing is left to do it says so and exits 0.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from modelcache.kube.client import (
    CONFIG_MAPS,
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    PERSISTENT_VOLUME_CLAIMS,
    SECRETS,
    SERVICE_ACCOUNTS,
    Kube,
    Resource,
)
from modelcache.kube.objects import meta
from modelcache.kube.quantity import parse_quantity
from modelcache.kube.types import norm_path, pv_root
from modelcache.kube.views import CacheView

DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment", True)
DAEMON_SETS = Resource("apps", "v1", "daemonsets", "DaemonSet", True)
JOBS = Resource("batch", "v1", "jobs", "Job", True)
VALIDATING_WEBHOOKS = Resource("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations",
                               "ValidatingWebhookConfiguration", False)
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False)

#: KServe's objects (config/localmodels, config/localmodelnodes, its Helm charts use the same names).
KSERVE_CONTROLLER = "kserve-localmodel-controller-manager"
KSERVE_AGENT = "kserve-localmodelnode-agent"
KSERVE_WEBHOOK = "localmodelcache.serving.kserve.io"
KSERVE_CONFIG = "inferenceservice-config"
KSERVE_JOB_NAMESPACE = "kserve-localmodel-jobs"
#: Ours (deploy/).
OUR_NAMESPACE = "modelcache-system"
#: deploy/'s credential namespace (KServe's jobNamespace is kserve-localmodel-jobs).
CREDENTIALS_NAMESPACE = "modelcache-credentials"
OUR_AGENT = "modelcache-agent"
OUR_COORDINATOR = "modelcache-coordinator"
AGENT_ROOT_VOLUME = "hostroot"
DEFAULT_HOST_PATH = "/models"
OUR_CRDS = ("localmodelcaches", "localmodelnamespacecaches", "localmodelnodes", "localmodelnodegroups",
            "clusterstoragecontainers")


@dataclass(frozen=True)
class Step:
    """One thing to do: what was found (one line), and the commands, in order."""

    check: str
    finding: str
    commands: tuple[str, ...] = ()
    #: False: worth doing, but the switch works without it (leftovers to clean up).
    blocking: bool = True
    #: What is done outside the cluster (a cloud's IAM), printed as comment lines after the finding.
    notes: tuple[str, ...] = ()
    #: How a step that does not block is shown (leftovers: optional; a warning says what to expect).
    label: str = "optional"


WARNING = "a warning: it does not block the switch"


@dataclass(frozen=True)
class SourceCheck:
    """One cache's source listed as our agent will list it (agent/precheck.py fills these)."""

    cache: str  # name, or namespace/name
    uri: str  # redacted
    #: "ok", "failed" (the listing failed: ``detail`` says why), "keyless" (no credentials: the
    #: agent's own identity decides, which cannot be tried from here), "refused" (a URI we do not read).
    outcome: str
    detail: str = ""
    files: int = 0
    bytes: int = 0


@dataclass
class Facts:
    """What the checks look at, read once."""

    kserve_namespace: str = "kserve"
    credentials_namespace: str = CREDENTIALS_NAMESPACE
    controllers: list[dict[str, Any]] = field(default_factory=list)  # KServe's cache controller Deployments
    agents: list[dict[str, Any]] = field(default_factory=list)  # KServe's node agent DaemonSets
    webhook: dict[str, Any] | None = None
    isvc_config: dict[str, Any] | None = None
    crds: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    our_agent: dict[str, Any] | None = None
    our_coordinator: dict[str, Any] | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)
    caches: list[dict[str, Any]] = field(default_factory=list)  # cluster and namespace caches
    #: (kind, namespace, name) -> exists, for the credentials the caches name.
    present: dict[tuple[str, str, str], bool] = field(default_factory=dict)
    #: service account name -> secret names, for those found in KServe's job namespace.
    sa_secrets: dict[str, list[str]] = field(default_factory=dict)
    job_leftovers: int = 0
    pvc_leftovers: list[str] = field(default_factory=list)
    #: The identity KServe's download Jobs run as (``default`` in its job namespace: its Job pod
    #: sets no serviceAccountName) and our agent's ServiceAccount.
    job_identity: dict[str, Any] | None = None
    agent_account: dict[str, Any] | None = None
    #: Every cache's source, listed with the credentials the agent will use (None: not listed).
    sources: list[SourceCheck] | None = None

    @property
    def local_model(self) -> dict[str, Any]:
        return parse_config_json(((self.isvc_config or {}).get("data") or {}).get("localModel"))

    @property
    def credentials(self) -> dict[str, Any]:
        return parse_config_json(((self.isvc_config or {}).get("data") or {}).get("credentials"))

    @property
    def job_namespace(self) -> str:
        return str(self.local_model.get("jobNamespace") or KSERVE_JOB_NAMESPACE)

    @property
    def storage_secret(self) -> str:
        return str(self.credentials.get("storageSpecSecretName") or "storage-config")


def parse_config_json(text: str | None) -> dict[str, Any]:
    """A JSON block of inferenceservice-config; KServe's shipped one has ``#`` comment lines."""
    if not text:
        return {}
    lines = [ln for ln in str(text).splitlines() if not ln.lstrip().startswith("#")]
    try:
        doc = json.loads("\n".join(lines))
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _named(kube: Kube, res: Resource, name: str) -> list[dict[str, Any]]:
    return list(kube.list(res, None, field_selector=f"metadata.name={name}").get("items") or [])


def gather(kube: Kube, kserve_namespace: str = "kserve", credentials_namespace: str | None = None) -> Facts:
    f = Facts(kserve_namespace=kserve_namespace)
    f.controllers = _named(kube, DEPLOYMENTS, KSERVE_CONTROLLER)
    f.agents = _named(kube, DAEMON_SETS, KSERVE_AGENT)
    f.webhook = kube.get_or_none(VALIDATING_WEBHOOKS, KSERVE_WEBHOOK)
    f.isvc_config = kube.get_or_none(CONFIG_MAPS, KSERVE_CONFIG, kserve_namespace)
    f.crds = {p: kube.get_or_none(CRDS, f"{p}.serving.kserve.io") for p in OUR_CRDS}
    f.our_agent = kube.get_or_none(DAEMON_SETS, OUR_AGENT, OUR_NAMESPACE)
    f.our_coordinator = kube.get_or_none(DEPLOYMENTS, OUR_COORDINATOR, OUR_NAMESPACE)
    f.credentials_namespace = credentials_namespace or _agent_env(f.our_agent, "MODELCACHE_CREDENTIALS_NAMESPACE") \
        or CREDENTIALS_NAMESPACE
    if f.crds.get("localmodelnodegroups"):
        f.groups = list(kube.list(LOCAL_MODEL_NODE_GROUPS).get("items") or [])
    if f.crds.get("localmodelcaches"):
        f.caches += list(kube.list(LOCAL_MODEL_CACHES).get("items") or [])
    if f.crds.get("localmodelnamespacecaches"):
        f.caches += list(kube.list(LOCAL_MODEL_NAMESPACE_CACHES).get("items") or [])
    for kind, name in _credential_refs(f):
        res = SERVICE_ACCOUNTS if kind == "serviceaccount" else SECRETS
        for ns in (f.credentials_namespace, f.job_namespace):
            obj = kube.get_or_none(res, name, ns)
            f.present[(kind, ns, name)] = obj is not None
            if obj is not None and kind == "serviceaccount" and ns == f.job_namespace:
                f.sa_secrets[name] = [str(s.get("name")) for s in obj.get("secrets") or [] if s.get("name")]
    for secrets in f.sa_secrets.values():
        for name in secrets:
            for ns in (f.credentials_namespace, f.job_namespace):
                f.present.setdefault(("secret", ns, name),
                                     kube.get_or_none(SECRETS, name, ns) is not None)
    f.job_identity = kube.get_or_none(SERVICE_ACCOUNTS, "default", f.job_namespace)
    f.agent_account = kube.get_or_none(SERVICE_ACCOUNTS, OUR_AGENT, OUR_NAMESPACE)
    f.job_leftovers = len(kube.list(JOBS, f.job_namespace, label_selector="model,node").get("items") or [])
    names = {f"{meta(c).name}-{g}" for c in f.caches for g in CacheView(c).node_groups}
    pvcs = [meta(p).name for p in kube.list(PERSISTENT_VOLUME_CLAIMS, f.job_namespace).get("items") or []]
    f.pvc_leftovers = sorted(n for n in pvcs if n in names or n.endswith("-download"))
    return f


def _agent_env(ds: dict[str, Any] | None, name: str) -> str | None:
    return agent_plain_env(ds).get(name)


def agent_plain_env(ds: dict[str, Any] | None) -> dict[str, str]:
    """The plain ``value`` environment of our agent's containers (what its downloads start from)."""
    out: dict[str, str] = {}
    for c in (((ds or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []:
        for env in c.get("env") or []:
            if env.get("name") and env.get("value"):
                out.setdefault(str(env["name"]), str(env["value"]))
    return out


def cache_name(c: dict[str, Any]) -> str:
    return meta(c).key


def keyless(c: dict[str, Any]) -> bool:
    """A cache that names no credentials: its download runs with the identity of whatever runs it
    (KServe: its Job's pod, ``default`` in the job namespace; ours: the agent's pod)."""
    spec = c.get("spec") or {}
    storage = spec.get("storage") or {}
    return not spec.get("serviceAccountName") and not (storage.get("key") or storage.get("parameters"))


def _credential_refs(f: Facts) -> Iterable[tuple[str, str]]:
    seen: set[tuple[str, str]] = set()
    for c in f.caches:
        spec = c.get("spec") or {}
        refs = []
        storage = spec.get("storage") or {}
        if storage.get("key") is not None or storage.get("parameters"):
            # (parameters without a key: the agent reads storage-config's default_<type>/default key)
            refs.append(("secret", f.storage_secret))
        elif spec.get("serviceAccountName"):
            refs.append(("serviceaccount", str(spec["serviceAccountName"])))
        for ref in refs:
            if ref not in seen:
                seen.add(ref)
                yield ref


def agent_host_path(ds: dict[str, Any] | None) -> str:
    """The host directory of our agent's root (deploy/'s default before it is installed)."""
    for vol in (((ds or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get("volumes") or []:
        if vol.get("name") == AGENT_ROOT_VOLUME and (vol.get("hostPath") or {}).get("path"):
            return norm_path(str(vol["hostPath"]["path"]))
    return DEFAULT_HOST_PATH


def group_path(group: dict[str, Any]) -> str | None:
    return pv_root((group.get("spec") or {}).get("persistentVolumeSpec") or {})


def _q(text: str) -> str:
    return shlex.quote(text)


def _copy(kind: str, name: str, src: str, dst: str) -> str:
    """Copy one object between namespaces with kubectl alone (no jq): drop what names its origin."""
    drop = " ".join(f"-e '/^  {k}:/d'" for k in ("namespace", "resourceVersion", "uid", "creationTimestamp"))
    return f"kubectl -n {src} get {kind} {_q(name)} -o yaml | sed {drop} | kubectl -n {dst} create -f -"


# ---- checks, in the order of the switch-over -------------------------------------------------

Check = Callable[[Facts], list[Step]]
CHECKS: list[tuple[str, Check]] = []


def check(name: str) -> Callable[[Check], Check]:
    def deco(fn: Check) -> Check:
        CHECKS.append((name, fn))
        return fn

    return deco


@check("kserve-agent")
def _kserve_agent(f: Facts) -> list[Step]:
    return [Step("kserve-agent", f"KServe's node agent (DaemonSet {meta(d).namespace}/{KSERVE_AGENT}) is "
                 "installed: it and ours would write the same model folders and LocalModelNode status",
                 (f"kubectl -n {meta(d).namespace} delete daemonset {KSERVE_AGENT}",)) for d in f.agents]


@check("kserve-controller")
def _kserve_controller(f: Facts) -> list[Step]:
    out = []
    for d in f.controllers:
        if ((d.get("spec") or {}).get("replicas", 1) or 0) == 0:
            continue
        ns = meta(d).namespace
        out.append(Step("kserve-controller", f"KServe's local model controller (Deployment {ns}/{KSERVE_CONTROLLER}) "
                        "runs: it and our coordinator would both write LocalModelNodes, cache status and volumes "
                        "(scaled to 0, it is there for the way back)",
                        (f"kubectl -n {ns} scale deployment {KSERVE_CONTROLLER} --replicas=0",)))
    return out


@check("kserve-webhook")
def _kserve_webhook(f: Facts) -> list[Step]:
    if f.webhook is None:
        return []
    return [Step("kserve-webhook", f"KServe's cache webhook ValidatingWebhookConfiguration {KSERVE_WEBHOOK} is "
                 "registered: with its controller stopped its server is gone, and it fails closed (every cache "
                 "create or update refused); ours validates the same rules",
                 (f"kubectl delete validatingwebhookconfiguration {KSERVE_WEBHOOK}",))]


@check("local-model-enabled")
def _local_model_enabled(f: Facts) -> list[Step]:
    if f.isvc_config is None:
        return []
    local = f.local_model
    if local.get("enabled") is True:
        return []
    patched = json.dumps({**local, "enabled": True}, indent=2)
    patch = json.dumps({"data": {"localModel": patched}})
    ns = meta(f.isvc_config).namespace
    return [Step("local-model-enabled", f"ConfigMap {ns}/{KSERVE_CONFIG} has localModel.enabled "
                 f"{json.dumps(local.get('enabled', False))}: KServe's defaulter then strips the cache label from "
                 "every InferenceService it admits; it must be true",
                 (f"kubectl -n {ns} patch configmap {KSERVE_CONFIG} --type merge -p {_q(patch)}",))]


@check("crds")
def _crds(f: Facts) -> list[Step]:
    out = []
    missing = [p for p, crd in f.crds.items() if crd is None]
    kserves = [p for p, crd in f.crds.items() if crd is not None and not _ours(crd)]
    if missing or kserves:
        what = (f"missing: {', '.join(missing)}" if missing else "") + ("; " if missing and kserves else "") + (
            f"KServe's, not ours: {', '.join(kserves)}" if kserves else "")
        out.append(Step("crds", f"CRDs {what}: ours are KServe's field for field plus the status our agent and "
                        "coordinator write (KServe's would prune it); objects are kept when a CRD is replaced",
                        ("kubectl apply --server-side --force-conflicts -f deploy/crds/",)))
    helm = [p for p, crd in f.crds.items() if crd is not None and
            meta(crd).labels.get("app.kubernetes.io/managed-by") == "Helm"
            and meta(crd).annotations.get("helm.sh/resource-policy") != "keep"]
    for p in helm:
        out.append(Step("crds-helm", f"CRD {p}.serving.kserve.io is managed by Helm (kserve-localmodel-crd): a helm "
                        "upgrade would revert it to KServe's, an uninstall would delete it with every cache; keep "
                        "it, and stop upgrading that chart", (f"kubectl annotate crd {p}.serving.kserve.io "
                                                               "helm.sh/resource-policy=keep --overwrite",)))
    return out


def _ours(crd: dict[str, Any]) -> bool:
    """Ours have printer columns on every kind (KServe's have none)."""
    return any(v.get("additionalPrinterColumns") for v in (crd.get("spec") or {}).get("versions") or [])


@check("credentials")
def _credentials(f: Facts) -> list[Step]:
    out = []
    ours, theirs = f.credentials_namespace, f.job_namespace
    for kind, name in _credential_refs(f):
        if f.present.get((kind, ours, name)):
            continue
        if not f.present.get((kind, theirs, name)):
            out.append(Step("credentials", f"{kind} {name} (named by a cache) is neither in {ours} nor in KServe's "
                            f"{theirs}: the download of its models fails; create it in {ours}",
                            (f"kubectl -n {ours} get {kind} {_q(name)}",)))
            continue
        commands = [_copy(kind, name, theirs, ours)]
        for secret in f.sa_secrets.get(name, []) if kind == "serviceaccount" else []:
            if not f.present.get(("secret", ours, secret)) and f.present.get(("secret", theirs, secret)):
                commands.append(_copy("secret", secret, theirs, ours))
        out.append(Step("credentials", f"{kind} {name} is in KServe's job namespace {theirs}; our agent reads "
                        f"credentials in {ours} only", tuple(commands)))
    return out


@check("uris")
def _uris(f: Facts) -> list[Step]:
    """Cache URIs modelcache does not read (KServe v0.20.0 may): the copy KServe downloaded stays
    served, counted on its word and never verified (docs/kserve-compat.md); a new one is not made."""
    from modelcache.errors import ModelcacheError
    from modelcache.sources.uri import parse_uri

    out = []
    for c in f.caches:
        uri = CacheView(c).source_model_uri
        try:
            parse_uri(uri)
        except ModelcacheError as exc:
            reason = str(exc).split(". Accepted forms:", 1)[0]
            out.append(Step("uris", f"cache {cache_name(c)}: {reason}: copies KServe downloaded stay served but "
                            "unverified, and no new node gets one; a ClusterStorageContainer with workloadType "
                            "localModelDownloadJob can download it, or re-create the cache with a URI modelcache "
                            "reads (docs/kserve-compat.md)", blocking=False, label=WARNING))
    return out


@check("install")
def _install(f: Facts) -> list[Step]:
    if f.our_agent is not None and f.our_coordinator is not None:
        return []
    return [Step("install", "modelcache is not installed (DaemonSet and Deployment in "
                 f"{OUR_NAMESPACE}); set the agent's host path first (next check) if your node groups' PVs name "
                 f"another directory than {DEFAULT_HOST_PATH}", ("kubectl apply -k deploy/",))]


@check("host-path")
def _host_path(f: Facts) -> list[Step]:
    agent = agent_host_path(f.our_agent)
    paths = {meta(g).name: group_path(g) for g in f.groups}
    differ = {g: p for g, p in paths.items() if p != agent}
    if not differ:
        return []
    distinct = sorted({p for p in paths.values() if p})
    listing = ", ".join(f"{g}: {p or 'no local.path'}" for g, p in sorted(differ.items()))
    if len(distinct) == 1 and all(paths.values()):
        want = distinct[0]
        patch = json.dumps({"spec": {"template": {"spec": {"volumes": [
            {"name": AGENT_ROOT_VOLUME, "hostPath": {"path": want, "type": "DirectoryOrCreate"}}]}}}})
        cmd = f"kubectl -n {OUR_NAMESPACE} patch daemonset {OUR_AGENT} --type strategic -p {_q(patch)}"
        return [Step("host-path", f"the agent's root is host path {agent} but the node groups' PVs name {want} "
                     f"({listing}): the models KServe downloaded are there, and serving pods read them there; "
                     f"point the agent at {want}" + ("" if f.our_agent else " (after installing)"), (cmd,))]
    return [Step("host-path", f"node groups' PVs name different host paths ({listing}; the agent's root is {agent}): "
                 "one agent root serves one path; give every group the agent's path",
                 tuple(f"kubectl patch localmodelnodegroup {_q(g)} --type merge -p "
                       + _q(json.dumps({"spec": {"persistentVolumeSpec": {"local": {"path": agent}}}}))
                       for g in sorted(differ)))]


#: Workload identity as each cloud binds it to a Kubernetes ServiceAccount (annotation -> cloud).
IDENTITY_ANNOTATIONS = {
    "eks.amazonaws.com/role-arn": "AWS IRSA",
    "iam.gke.io/gcp-service-account": "GKE Workload Identity",
    "azure.workload.identity/client-id": "Azure Workload Identity",
}
#: URI kinds whose keyless download uses the cloud identity of the pod that runs it.
IDENTITY_KINDS = {"s3": "AWS", "gcs": "GCP", "azure": "Azure"}


@check("identity")
def _identity(f: Facts) -> list[Step]:
    """Keyless caches on a cloud's storage read it with the workload identity KServe's download
    Jobs run as (``default`` in its job namespace); our agent runs as its own ServiceAccount, so
    that identity must be bound to it as well (docs/kserve-compat.md, Workload identity)."""
    from modelcache.errors import ModelcacheError
    from modelcache.sources.uri import parse_uri

    clouds: dict[str, list[str]] = {}
    for c in f.caches:
        if not keyless(c):
            continue
        try:
            location = parse_uri(CacheView(c).source_model_uri)
        except ModelcacheError:
            continue
        kind = location.kind
        if getattr(location, "sas", ""):
            continue  # an Azure URI with a SAS carries its own credential
        if kind in IDENTITY_KINDS:
            clouds.setdefault(IDENTITY_KINDS[kind], []).append(cache_name(c))
    if not clouds:
        return []
    theirs, ours = meta(f.job_identity).annotations, meta(f.agent_account).annotations
    where = f"{f.job_namespace}/default"
    agent = f"{OUR_NAMESPACE}/{OUR_AGENT}"
    subject = f"system:serviceaccount:{OUR_NAMESPACE}:{OUR_AGENT}"
    out = []
    for annotation, cloud in IDENTITY_ANNOTATIONS.items():
        value = theirs.get(annotation)
        names = clouds.get({"AWS IRSA": "AWS", "GKE Workload Identity": "GCP",
                            "Azure Workload Identity": "Azure"}[cloud], [])
        if not value or not names or ours.get(annotation) == value:
            continue
        commands = [f"kubectl -n {OUR_NAMESPACE} annotate serviceaccount {OUR_AGENT} {annotation}={_q(value)} "
                    "--overwrite"]
        if cloud == "AWS IRSA":
            notes = (f"in IAM, allow {subject} in the trust policy of role {value} (its condition on "
                     "<oidc-provider>:sub names the ServiceAccount: add this one beside KServe's)",)
        elif cloud == "GKE Workload Identity":
            project = value.split("@", 1)[1].split(".", 1)[0] if "@" in value else "<project>"
            notes = (f"gcloud iam service-accounts add-iam-policy-binding {value} --role "
                     f"roles/iam.workloadIdentityUser --member 'serviceAccount:{project}.svc.id.goog"
                     f"[{OUR_NAMESPACE}/{OUR_AGENT}]'",)
        else:
            commands.append(f"kubectl -n {OUR_NAMESPACE} patch daemonset {OUR_AGENT} --type merge -p "
                            + _q(json.dumps({"spec": {"template": {"metadata": {"labels": {
                                "azure.workload.identity/use": "true"}}}}})))
            notes = (f"az identity federated-credential create --name {OUR_AGENT} --identity-name <identity of "
                     f"client {value}> --resource-group <group> --issuer <cluster OIDC issuer> --subject {subject}",)
        # (after the install step: the ServiceAccount and DaemonSet are deploy/'s; a running agent
        # only gets the identity's token in a new pod)
        commands.append(f"kubectl -n {OUR_NAMESPACE} rollout restart daemonset {OUR_AGENT}")
        out.append(Step("identity", f"{cloud} is bound to KServe's download identity {where} ({annotation}={value}) "
                        f"and keyless caches use it ({', '.join(sorted(names))}); our agent downloads as {agent}: "
                        "bind it there too", tuple(commands), notes=notes))
    found = {c for a, c in IDENTITY_ANNOTATIONS.items() if theirs.get(a)}
    aws = clouds.get("AWS", [])
    if aws and "AWS IRSA" not in found and not ours.get("eks.amazonaws.com/role-arn"):
        out.append(Step("identity", f"keyless S3 caches ({', '.join(sorted(aws))}) name no credentials and "
                        f"{where} has no IRSA annotation: KServe's Jobs got AWS access another way (EKS Pod "
                        "Identity, the node's instance role); our agent needs the same access", blocking=False,
                        label=WARNING,
                        notes=(f"EKS Pod Identity: aws eks create-pod-identity-association --cluster <cluster> "
                               f"--namespace {OUR_NAMESPACE} --service-account {OUR_AGENT} --role-arn <the role "
                               f"associated with {where}>",
                               "instance role: nothing to do if the agent's nodes have it")))
    return out


@check("sources")
def _sources(f: Facts) -> list[Step]:
    """Each cache's source listed as our agent will list it (before the switch): a copy KServe
    downloaded is verified against that listing; while it fails the copy is served unverified."""
    out = []
    for check_ in f.sources or []:
        if check_.outcome == "failed":
            out.append(Step("sources", f"cache {check_.cache}: listing {check_.uri} with the credentials the agent "
                            f"will use failed: {check_.detail}; the copies KServe downloaded stay served, "
                            "unverified, until it can be listed, and no new node gets one", blocking=False,
                            label=WARNING))
        elif check_.outcome == "keyless" and not any(s.check == "identity" for s in _identity(f)):
            out.append(Step("sources", f"cache {check_.cache}: {check_.uri} names no credentials: the agent's own "
                            "identity reads it (not tried from here)", blocking=False, label=WARNING))
    return out


@check("storage-limit")
def _storage_limit(f: Facts) -> list[Step]:
    out = []
    for g in f.groups:
        name = meta(g).name
        limit = parse_quantity((g.get("spec") or {}).get("storageLimit"))
        sizes = [parse_quantity(CacheView(c).model_size) or 0 for c in f.caches if name in CacheView(c).node_groups]
        need = sum(sizes)
        if limit is None or need <= limit:
            continue
        gib = -(-need // (1 << 30))
        out.append(Step("storage-limit", f"node group {name}: its caches' modelSize add up to {need} bytes, over its "
                        f"storageLimit {g['spec']['storageLimit']}; modelcache enforces storageLimit (KServe does "
                        "not), so a model that does not fit is refused", (
                            f"kubectl patch localmodelnodegroup {_q(name)} --type merge -p "
                            + _q(json.dumps({"spec": {"storageLimit": f"{gib}Gi"}})),)))
    return out


@check("kserve-leftovers")
def _leftovers(f: Facts) -> list[Step]:
    if f.agents or (f.our_agent is None):
        return []  # still KServe's, or not switched yet: its Jobs and PVCs are in use
    out = []
    if f.job_leftovers:
        out.append(Step("kserve-leftovers", f"{f.job_leftovers} download Job(s) of KServe's agent are left in "
                        f"{f.job_namespace}", (f"kubectl -n {f.job_namespace} delete jobs -l model,node",),
                        blocking=False))
    if f.pvc_leftovers:
        out.append(Step("kserve-leftovers", f"KServe's download PVCs are left in {f.job_namespace}: "
                        f"{', '.join(f.pvc_leftovers)}",
                        tuple(f"kubectl -n {f.job_namespace} delete pvc {_q(p)}" for p in f.pvc_leftovers),
                        blocking=False))
    return out


def plan(facts: Facts) -> list[Step]:
    return [step for _name, fn in CHECKS for step in fn(facts)]


def render(steps: list[Step], where: str) -> str:
    """Comment lines say what was found; every other line is a command, in order."""
    lines = [f"# modelcache migrate: switching {where} from KServe's local model cache"]
    if not [s for s in steps if s.blocking]:
        lines.append("# nothing blocks the switch" + (": leftovers to clean up below" if steps else
                                                        ": nothing left to do"))
    for i, step in enumerate(steps, 1):
        lines.append(f"# {i}. [{step.check}] {step.finding}" + ("" if step.blocking else f" ({step.label})"))
        lines.extend(f"#    {note}" for note in step.notes)
        lines.extend(step.commands)
    return "\n".join(lines)
