"""Render the Helm chart charts/modelcache/ from deploy/ (`make chart`).

deploy/ is the one source of truth: every object of the chart is an object of `kubectl kustomize
deploy/` (the CRDs: deploy/crds/ as they are), with its values put in at named places (POINTS, the
image, the credential namespace) whose defaults are read from deploy/, so `helm template` with
default values renders what `kustomize build deploy/` does, field for field (tests/test_chart.py).
An optional kustomize component of deploy/components/ is a boolean value (VARIANTS): each object the
component changes is rendered both ways under an `if`.

A change to deploy/ needs `make chart` (the test says so when the committed chart is stale); a
change that removes a place a value points at fails here, naming it, instead of dropping the value.

Usage: python charts/generate.py [--check] [--kubectl PATH]
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
CHART = REPO / "charts" / "modelcache"
Obj = dict[str, Any]
Step = str | int | tuple[str, str]  # a key, a list index, or (field, value): the list item whose field is value
GENERATED = "# Generated from deploy/ by charts/generate.py (`make chart`): edit deploy/, not this file.\n"


@dataclass(frozen=True)
class Point:
    """A value of the chart: ``key`` (dotted, in values.yaml) replaces the field at ``path`` of
    object ``kind``/``name``; its default is what deploy/ has there. ``block``: a map or list
    (toYaml), else a scalar (toJson: strings quoted, numbers not)."""

    key: str
    kind: str
    name: str
    path: tuple[Step, ...]
    doc: str
    block: bool = False
    enum: tuple[str, ...] = ()


@dataclass(frozen=True)
class Variant:
    """An optional component of deploy/components/, on when the boolean value ``key`` is true."""

    key: str
    component: str
    doc: str


AGENT = ("DaemonSet", "modelcache-agent")
COORDINATOR = ("Deployment", "modelcache-coordinator")
AGENT_POD = ("spec", "template", "spec")
AGENT_CONTAINER = (*AGENT_POD, "containers", ("name", "agent"))
COORDINATOR_CONTAINER = (*AGENT_POD, "containers", ("name", "coordinator"))

POINTS: tuple[Point, ...] = (
    Point("agent.hostPath", *AGENT, (*AGENT_POD, "volumes", ("name", "hostroot"), "hostPath", "path"),
          "The node directory the agent fills (models in <hostPath>/models/<storageKey>). It must equal your "
          "LocalModelNodeGroups' persistentVolumeSpec.local.path: serving pods read the files through that PV. "
          "KServe's kustomize uses /models, its Helm chart /mnt/models."),
    Point("agent.nodeSelector", *AGENT, (*AGENT_POD, "nodeSelector"),
          "Where the agent runs: KServe's label for local-model nodes by default. Helm merges a map given here "
          "over this one (--set agent.nodeSelector.gpu=a100 adds a label); set a default label to null to drop it.",
          block=True),
    Point("agent.tolerations", *AGENT, (*AGENT_POD, "tolerations"),
          "Every taint by default: model nodes are tainted GPU nodes, and the nodeSelector alone decides.",
          block=True),
    Point("agent.resources", *AGENT, (*AGENT_CONTAINER, "resources"),
          "The agent container's requests and limits (memory covers the chunk buffers of parallel transfers).",
          block=True),
    Point("agent.peers", "ConfigMap", "modelcache-agent", ("data", "MODELCACHE_PEERS"),
          "Peer transfer between the agents of a node group (docs/peers.md): auto (on while the peer token is "
          "mounted), on, or off (every node reads every byte from the origin).", enum=("auto", "on", "off")),
    Point("coordinator.replicas", *COORDINATOR, ("spec", "replicas"),
          "Coordinator replicas: one holds the Lease and reconciles, every one serves the webhooks."),
    Point("coordinator.resources", *COORDINATOR, (*COORDINATOR_CONTAINER, "resources"),
          "The coordinator container's requests and limits.", block=True),
)

VARIANTS: tuple[Variant, ...] = (
    Variant("webhooks.certManager.enabled", "cert-manager",
            "The webhook certificate from cert-manager (an Issuer and a Certificate; its CA injector fills the "
            "webhook configurations) instead of the coordinator's own, self-provisioned and renewed one."),
    Variant("monitoring.enabled", "monitoring",
            "PodMonitors for the agents and coordinators and a PrometheusRule with monitoring/alerts.yaml "
            "(the Prometheus Operator's CRDs must be installed)."),
)

RULES = REPO / "monitoring" / "alerts.yaml"
PROMETHEUS_RULE = DEPLOY / "components" / "monitoring" / "prometheusrule.yaml"

#: A namespace of deploy/ that is a value: every string naming it, wherever it is, is the value.
RENAMES = {
    "modelcache-credentials": ("credentialsNamespace",
                               "Where the agent reads the Secrets and ServiceAccounts that caches name (KServe's "
                               "jobNamespace); created by the chart with the strictest Pod Security level."),
}


class DeployChanged(Exception):
    """deploy/ no longer has a place a value of the chart points at."""


def kubectl() -> str:
    for candidate in (os.environ.get("KUBECTL"), str(REPO / ".work" / "cluster" / "bin" / "kubectl"),
                      shutil.which("kubectl")):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit("charts/generate.py: no kubectl (run `make test-deps`, or set KUBECTL=...)")


def kustomize(folder: Path, kubectl_path: str) -> list[Obj]:
    out = subprocess.run([kubectl_path, "kustomize", str(folder)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"kubectl kustomize {folder}: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def with_component(component: str, kubectl_path: str) -> list[Obj]:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(DEPLOY, tmp)],
            "components": [os.path.relpath(DEPLOY / "components" / component, tmp)]}))
        return kustomize(Path(tmp), kubectl_path)


def ident(obj: Obj) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def locate(obj: Obj, path: tuple[Step, ...], what: str) -> tuple[Any, str | int]:
    """The container of the field at ``path`` and the field's key or index."""
    node: Any = obj
    for i, step in enumerate(path):
        last = i == len(path) - 1
        if isinstance(step, tuple):
            field, value = step
            matches = [j for j, item in enumerate(node if isinstance(node, list) else [])
                       if isinstance(item, dict) and item.get(field) == value]
            if len(matches) != 1:
                raise DeployChanged(f"{what}: no single list item with {field}={value}")
            if last:
                return node, matches[0]
            node = node[matches[0]]
        else:
            ok = isinstance(node, dict) and step in node if isinstance(step, str) else isinstance(node, list)
            if not ok:
                raise DeployChanged(f"{what}: no field {step!r}")
            if last:
                return node, step
            node = node[step]
    raise DeployChanged(f"{what}: empty path")


def value_ref(key: str, *more: str) -> str:
    """The template reference of a value: ``key`` dotted, ``more``: further keys that may hold dots."""
    parts = [*key.split("."), *more]
    if all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in parts):
        return ".Values." + key
    head = ".Values." + ".".join(parts[:-len(more)] if more else parts[:-1])
    tail = " ".join(f'"{p}"' for p in (more or parts[-1:]))
    return f"(index {head} {tail})"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (scripts, PromQL) as literal blocks, as they are written in deploy/."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value and not value.endswith((" ", "\t")) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


class Templater:
    """Puts marks into objects where values go, then turns the marks of the dumped YAML into
    template actions: a scalar inline, as JSON (a string quoted, a number not); a block as toYaml at
    the field's indentation."""

    def __init__(self) -> None:
        self.actions: list[tuple[str, bool]] = []

    def mark(self, expression: str, block: bool) -> str:
        self.actions.append((expression, block))
        return f"@@MARK{len(self.actions) - 1}@@"

    def render(self, obj: Obj) -> str:
        text = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=10_000, default_flow_style=False)
        # Braces of deploy/'s own (alert templates: {{ $labels.node }}) are text, not Helm's actions.
        text = re.sub(r"\{\{|\}\}", lambda m: '{{ "{{" }}' if m[0] == "{{" else '{{ "}}" }}', text)

        def block(m: re.Match[str]) -> str:
            expr, is_block = self.actions[int(m["n"])]
            if not is_block:
                return m[0]
            prefix, key = m["prefix"], m["key"]
            return f"{prefix}{key}:\n{{{{- toYaml {expr} | nindent {len(prefix) + 2} }}}}"

        text = re.sub(r"^(?P<prefix> *(?:- )?)(?P<key>[^:\n]+): '?@@MARK(?P<n>\d+)@@'?$", block, text, flags=re.M)
        return re.sub(r"'?@@MARK(\d+)@@'?", lambda m: f"{{{{ {self.actions[int(m[1])][0]} | toJson }}}}", text)


def image_ref() -> tuple[str, str]:
    (image,) = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["images"]
    return image["newName"], str(image["newTag"])


def defaults(base: list[Obj]) -> dict[str, Any]:
    """values.yaml's defaults: what deploy/ has at each place."""
    values: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        node = values
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value

    repo, tag = image_ref()
    put("image.repository", repo)
    put("image.tag", tag)
    objects = {(o["kind"], o["metadata"]["name"]): o for o in base}
    for p in POINTS:
        obj = objects.get((p.kind, p.name))
        if obj is None:
            raise DeployChanged(f"value {p.key}: deploy/ has no {p.kind}/{p.name}")
        holder, field = locate(obj, p.path, f"value {p.key} ({p.kind}/{p.name})")
        put(p.key, copy.deepcopy(holder[field]))
    for name, (key, _doc) in RENAMES.items():
        put(key, name)
    for v in VARIANTS:
        put(v.key, False)
    for hook_config in [o for o in base if o["kind"].endswith("WebhookConfiguration")]:
        for hook in hook_config.get("webhooks", []):
            values.setdefault("webhooks", {}).setdefault("failurePolicy", {})[hook["name"]] = hook["failurePolicy"]
    return values


def templated(obj: Obj, t: Templater) -> Obj:
    """A copy of ``obj`` with marks where the values go."""
    obj = copy.deepcopy(obj)
    repo, tag = image_ref()
    ref = f"{repo}:{tag}"
    image = t.mark('(printf "%s:%s" .Values.image.repository .Values.image.tag)', False)

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "image" and v == ref:
                    node[k] = image
                else:
                    node[k] = walk(v)
            return node
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, str):
            for name, (key, _doc) in RENAMES.items():
                if node == name:
                    return t.mark(value_ref(key), False)
                if name in node:  # e.g. a DNS name or an annotation naming the namespace
                    raise DeployChanged(f"{ident(obj)}: {node!r} names {name} inside a longer string; "
                                        "give charts/generate.py a rule for it")
        return node

    for p in POINTS:
        if (obj["kind"], obj["metadata"]["name"]) == (p.kind, p.name):
            holder, field = locate(obj, p.path, f"value {p.key} ({p.kind}/{p.name})")
            holder[field] = t.mark(value_ref(p.key), p.block)
    if obj["kind"].endswith("WebhookConfiguration"):
        for hook in obj.get("webhooks", []):
            hook["failurePolicy"] = t.mark(value_ref("webhooks.failurePolicy", hook["name"]), False)
    return walk(obj)  # type: ignore[no-any-return]


#: A ConfigMap's values reach a pod only when it starts (envFrom is read then): the pod template of
#: each workload that reads a ConfigMap holding values carries their hash, so `helm upgrade --set
#: agent.peers=off` alone rolls the agents (and a rollback rolls them back). Only when the values differ
#: from deploy/'s: with defaults the chart stays exactly deploy/.
ROLLOUT_ANNOTATION = "modelcache.serving.kserve.io/config-values"


def config_points(obj: Obj) -> list[Point]:
    """The values a workload's pods read from ConfigMaps (envFrom, or a ConfigMap volume)."""
    pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    names = {e["configMapRef"]["name"] for c in [*pod.get("containers", []), *pod.get("initContainers", [])]
             for e in c.get("envFrom", []) if "configMapRef" in e}
    names |= {v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
    return [p for p in POINTS if p.kind == "ConfigMap" and p.name in names]


def with_rollout(text: str, obj: Obj, values: dict[str, Any]) -> str:
    points = config_points(obj)
    if not points:
        return text
    if ((obj["spec"]["template"].get("metadata") or {}).get("annotations")):
        raise DeployChanged(f"{ident(obj)}: its pod template has annotations now; give charts/generate.py a rule "
                            f"to add {ROLLOUT_ANNOTATION} beside them")
    anchor = "\n  template:\n    metadata:\n"
    if text.count(anchor) != 1:
        raise DeployChanged(f"{ident(obj)}: no single pod template metadata to annotate")

    def default(key: str) -> Any:
        node: Any = values
        for part in key.split("."):
            node = node[part]
        return node

    pairs = " ".join(f'"{p.key}" {value_ref(p.key)}' for p in points)
    # Helm's toJson is Go's json.Marshal: keys sorted, no spaces (these values are plain words).
    defaults_json = json.dumps({p.key: default(p.key) for p in points}, sort_keys=True, separators=(",", ":"))
    block = (f"{{{{- $config := dict {pairs} }}}}\n"
             f"{{{{- if ne (toJson $config) `{defaults_json}` }}}}\n"
             f"      annotations:\n"
             f"        {ROLLOUT_ANNOTATION}: {{{{ toJson $config | sha256sum | trunc 16 | quote }}}}\n"
             "{{- end }}\n")
    return text.replace(anchor, anchor + block)


def object_text(obj: Obj, values: dict[str, Any]) -> str:
    t = Templater()
    text = with_rollout(t.render(templated(obj, t)), obj, values)
    if obj["kind"] == "Namespace":
        # The release's own namespace exists already (`helm install -n NS --create-namespace`): Helm
        # could not own it, so the chart leaves it out (its Pod Security labels: docs/operations.md).
        name = obj["metadata"]["name"]
        release_ns = value_ref(RENAMES[name][0]) if name in RENAMES else f'"{name}"'
        text = f"{{{{- if ne .Release.Namespace {release_ns} }}}}\n{text}{{{{- end }}}}\n"
    return text


def template_files(base: list[Obj], variants: dict[Variant, list[Obj]]) -> dict[str, str]:
    """templates/<kind>-<name>.yaml for every object (CRDs go to crds/, copied)."""
    changed_by: dict[tuple[str, str, str], Variant] = {}
    bodies: dict[tuple[str, str, str], str] = {}
    order: list[tuple[str, str, str]] = []
    base_by = {ident(o): o for o in base}
    values = defaults(base)
    for o in base:
        if o["kind"] == "CustomResourceDefinition":
            continue
        order.append(ident(o))
        bodies[ident(o)] = object_text(o, values)
    for variant, objs in variants.items():
        cond = value_ref(variant.key)
        for o in objs:
            i = ident(o)
            if i in base_by and base_by[i] == o:
                continue
            if i in changed_by:
                raise DeployChanged(f"{i} is changed by {changed_by[i].component} and {variant.component}: "
                                    "charts/generate.py renders one optional component per object")
            changed_by[i] = variant
            if i in base_by:
                text = object_text(o, values)
                bodies[i] = f"{{{{- if {cond} }}}}\n{text}{{{{- else }}}}\n{bodies[i]}{{{{- end }}}}\n"
            else:
                order.append(i)
                bodies[i] = f"{{{{- if {cond} }}}}\n{object_text(o, values)}{{{{- end }}}}\n"
    files: dict[str, str] = {}
    for i in order:
        kind, _ns, name = i
        fname = f"templates/{kind.lower()}-{name}.yaml"
        assert fname not in files, fname
        files[fname] = GENERATED + bodies[i]
    return files


def values_text(values: dict[str, Any]) -> str:
    docs: dict[str, str] = {p.key: p.doc for p in POINTS}
    docs.update({v.key: v.doc for v in VARIANTS})
    docs.update({key: doc for key, doc in RENAMES.values()})
    docs["image"] = "One image for every role (deploy/kustomization.yaml's `images:` entry)."
    docs["webhooks.failurePolicy"] = ("Per webhook: Fail (closed) or Ignore (open). Which fail closed and why: "
                                      "docs/operations.md#webhooks.")
    lines = [GENERATED.rstrip("\n"), "# Defaults: what deploy/ has, so the chart renders it unchanged."]

    def wrap(text: str, indent: str) -> list[str]:
        out, line = [], ""
        for word in text.split():
            if line and len(indent) + len(line) + len(word) + 3 > 100:
                out.append(f"{indent}# {line}")
                line = word
            else:
                line = f"{line} {word}".strip()
        return [*out, f"{indent}# {line}"] if line else out

    def emit(node: dict[str, Any], prefix: str, depth: int) -> None:
        indent = "  " * depth
        for k, v in node.items():
            key = f"{prefix}{k}"
            if key in docs:
                lines.extend(wrap(docs[key], indent))
            if isinstance(v, dict) and v and not any(p.key == key and p.block for p in POINTS):
                lines.append(f"{indent}{json.dumps(k) if '.' in k else k}:")
                emit(v, key + ".", depth + 1)
            else:
                dumped = yaml.safe_dump({k: v}, sort_keys=False, width=10_000, default_flow_style=False)
                lines.extend(indent + line for line in dumped.rstrip("\n").splitlines())

    emit(values, "", 0)
    return "\n".join(lines) + "\n"


def schema(values: dict[str, Any]) -> dict[str, Any]:
    """values.schema.json: `helm lint` and `helm install` refuse a value of the wrong type or not
    among the allowed words before anything reaches the cluster."""
    enums = {p.key: list(p.enum) for p in POINTS if p.enum}

    def of(value: Any, key: str) -> dict[str, Any]:
        if key in enums:
            return {"type": "string", "enum": enums[key]}
        if key.startswith("webhooks.failurePolicy."):
            return {"type": "string", "enum": ["Fail", "Ignore"]}
        if isinstance(value, bool):
            return {"type": "boolean"}
        if isinstance(value, int):
            return {"type": "integer", "minimum": 0}
        if isinstance(value, str):
            return {"type": "string", "minLength": 1}
        if isinstance(value, list):
            return {"type": "array"}
        if any(p.key == key and p.block for p in POINTS):
            return {"type": "object"}
        return {"type": "object", "additionalProperties": False,
                "properties": {k: of(v, f"{key}.{k}" if key else k) for k, v in value.items()}}

    return {"$schema": "https://json-schema.org/draft-07/schema#", **of(values, "")}


def chart_yaml() -> str:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return GENERATED + yaml.safe_dump({
        "apiVersion": "v2", "name": "modelcache", "type": "application", "version": version, "appVersion": version,
        "description": "Model weights onto the nodes that serve them: fast, verified, crash-safe; a drop-in for "
                       "KServe's local model cache and storage initializer.",
        "kubeVersion": ">=1.29.0-0", "license": "Apache-2.0",
        "keywords": ["kserve", "model-cache", "machine-learning", "inference"],
    }, sort_keys=False, width=10_000)


NOTES = """modelcache {{ .Chart.AppVersion }} is installed: the agent runs on nodes labelled
{{ toYaml .Values.agent.nodeSelector }} and fills {{ .Values.agent.hostPath }} on each.

  kubectl label node <gpu-node> kserve/localmodel=worker     # where the agent runs (the default nodeSelector)
  modelcache status                                          # the fleet at a glance
{{- if eq .Release.Namespace "modelcache-system" }}

The release's namespace modelcache-system existed before the chart: it has none of deploy/'s Pod
Security labels. Where admission defaults are stricter than privileged, the agent's pods need
  kubectl label namespace modelcache-system pod-security.kubernetes.io/enforce=privileged
{{- end }}
"""


def prometheus_rule() -> str:
    """deploy/components/monitoring/prometheusrule.yaml: monitoring/alerts.yaml's groups as a
    PrometheusRule (the plain file is what promtool tests)."""
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "modelcache", "namespace": "modelcache-system",
                         "labels": {"app.kubernetes.io/part-of": "modelcache"}},
            "spec": yaml.safe_load(RULES.read_text())}
    return ("# Generated from monitoring/alerts.yaml by charts/generate.py (`make chart`): edit that file.\n"
            + yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=10_000))


def generate(kubectl_path: str) -> dict[str, str]:
    base = kustomize(DEPLOY, kubectl_path)
    variants = {v: with_component(v.component, kubectl_path) for v in VARIANTS}
    values = defaults(base)
    files = template_files(base, variants)
    files["Chart.yaml"] = chart_yaml()
    files["values.yaml"] = values_text(values)
    files["values.schema.json"] = json.dumps(schema(values), indent=2) + "\n"
    files["templates/NOTES.txt"] = NOTES
    files[".helmignore"] = GENERATED + "*.orig\n*.rej\n*~\n"
    for crd in sorted((DEPLOY / "crds").glob("*.yaml")):
        files[f"crds/{crd.name}"] = crd.read_text()
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if charts/modelcache/ differs from deploy/'s")
    parser.add_argument("--kubectl", default=None)
    parser.add_argument("--out", type=Path, default=CHART)
    args = parser.parse_args()
    rule = prometheus_rule()
    if args.check:
        if not PROMETHEUS_RULE.exists() or PROMETHEUS_RULE.read_text() != rule:
            print(f"{PROMETHEUS_RULE.relative_to(REPO)} is stale against monitoring/alerts.yaml: run `make chart` "
                  "and commit it", file=sys.stderr)
            return 1
    else:
        PROMETHEUS_RULE.write_text(rule)
    try:
        files = generate(args.kubectl or kubectl())
    except DeployChanged as exc:
        print(f"charts/generate.py: deploy/ changed under a value of the chart: {exc}", file=sys.stderr)
        return 1
    on_disk = {str(p.relative_to(args.out)): p.read_text() for p in args.out.rglob("*") if p.is_file()} \
        if args.out.exists() else {}
    if args.check:
        stale = sorted(set(files) ^ set(on_disk) | {f for f in files if on_disk.get(f) != files[f]})
        for f in stale:
            sys.stdout.writelines(difflib.unified_diff(on_disk.get(f, "").splitlines(True),
                                                       files.get(f, "").splitlines(True), f"a/{f}", f"b/{f}"))
        if stale:
            print(f"charts/modelcache/ is stale against deploy/ ({', '.join(stale)}): run `make chart` and "
                  "commit it", file=sys.stderr)
            return 1
        return 0
    for f in set(on_disk) - set(files):
        (args.out / f).unlink()
    for f, text in files.items():
        (args.out / f).parent.mkdir(parents=True, exist_ok=True)
        (args.out / f).write_text(text)
    print(f"charts/modelcache/: {len(files)} files from deploy/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
