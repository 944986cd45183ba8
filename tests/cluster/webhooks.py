"""Webhook configurations pointed at a webhook server running as a process on this machine:
deploy/'s at a coordinator, or KServe's own (tests/kserve) at its controllers.

There is no kube-proxy in the test control plane, so a webhook given as a Service cannot be
reached; the configurations are applied as shipped except `clientConfig`, which becomes a `url`
on the process's 127.0.0.1 port with the CA of its serving certificate as `caBundle`.
"""

from __future__ import annotations

import base64
import copy
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
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
               input=yaml.safe_dump_all(webhook_configurations(port, cert_file.read_bytes())))
