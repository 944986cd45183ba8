"""Webhook configurations pointed at a webhook server running as a process on this machine:
deploy/'s at a coordinator, or KServe's own (tests/kserve) at its controllers.

There is no kube-proxy in the test control plane, so a webhook given as a Service cannot be
reached; the configurations are applied as shipped except `clientConfig`, which becomes a `url`
on the process's 127.0.0.1 port with the CA of its serving certificate as `caBundle`.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.controlplane import ControlPlane

WEBHOOKS = Path(__file__).resolve().parents[2] / "deploy" / "webhooks"


def by_url(docs: list[dict[str, Any]], base_url: str, ca_pem: bytes) -> list[dict[str, Any]]:
    """Copies of the webhook configurations in ``docs``, each webhook called at ``base_url`` + its
    service path."""
    ca = base64.b64encode(ca_pem).decode()
    out = []
    for doc in docs:
        doc = copy.deepcopy(doc)
        for hook in doc["webhooks"]:
            svc = hook["clientConfig"].pop("service")
            hook["clientConfig"] = {"url": base_url.rstrip("/") + svc.get("path", "/"), "caBundle": ca}
        out.append(doc)
    return out


def webhook_configurations(port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    docs = [doc for path in sorted(WEBHOOKS.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return by_url(docs, f"https://127.0.0.1:{port}", ca_pem)


def register_webhooks(cp: ControlPlane, port: int, cert_file: Path) -> None:
    # Server-side apply by the same manager as `kubectl apply --server-side -k deploy/` drops the
    # `service` it applied before (a client-side apply would merge both and be refused).
    docs = webhook_configurations(port, cert_file.read_bytes())
    proc = cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(docs),
                      check=False)
    if proc.returncode == 0:
        return
    if "exactly one of url or service is required" not in proc.stderr:
        raise AssertionError(f"registering the webhooks failed: {proc.stderr.strip()}")
    # deploy/ was applied client-side, as docs/install.md does: its `service` belongs to another
    # field manager, which a server-side apply merges with the `url` (the API server refuses both).
    # Each webhook's clientConfig is replaced whole instead (a JSON patch, by the webhook's index).
    for doc in docs:
        kind = doc["kind"].lower()  # MutatingWebhookConfiguration -> mutatingwebhookconfiguration
        name = doc["metadata"]["name"]
        live = json.loads(cp.kubectl("get", kind, name, "-o", "json").stdout)
        index = {hook["name"]: i for i, hook in enumerate(live["webhooks"])}
        ops = [{"op": "replace", "path": f"/webhooks/{index[hook['name']]}/clientConfig", "value": hook["clientConfig"]}
               for hook in doc["webhooks"]]
        cp.kubectl("patch", kind, name, "--type", "json", "-p", json.dumps(ops))
