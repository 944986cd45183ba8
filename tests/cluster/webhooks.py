"""deploy/'s webhook configurations pointed at a coordinator running as a process on this machine.

There is no kube-proxy in the test control plane, so a webhook given as a Service cannot be
reached; the configurations are applied as shipped except `clientConfig`, which becomes a `url`
on the coordinator's port with its certificate as `caBundle`.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.controlplane import ControlPlane

WEBHOOKS = Path(__file__).resolve().parents[2] / "deploy" / "webhooks"


def webhook_configurations(port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    ca = base64.b64encode(ca_pem).decode()
    docs = []
    for path in sorted(WEBHOOKS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            doc = copy.deepcopy(doc)
            for hook in doc["webhooks"]:
                svc = hook["clientConfig"].pop("service")
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{svc['path']}", "caBundle": ca}
            docs.append(doc)
    return docs


def register_webhooks(cp: ControlPlane, port: int, cert_file: Path) -> None:
    # Server-side apply by the same manager as `kubectl apply --server-side -k deploy/` drops the
    # `service` it applied before (a client-side apply would merge both and be refused).
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
               input=yaml.safe_dump_all(webhook_configurations(port, cert_file.read_bytes())))
