"""Two tenants as the security review set them up (its 05-setup-tenants.sh), and an origin that
records what a download sends it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from tests.fixtures.cluster import Cluster


def make_tenant(cluster: Cluster, namespace: str) -> Path:
    """Namespace ``namespace`` with a user (ServiceAccount ``user``) holding ``edit`` there and every
    verb on namespace caches and InferenceServices; returns the user's kubeconfig."""
    docs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "user", "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "user-edit", "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
         "subjects": [{"kind": "ServiceAccount", "name": "user", "namespace": namespace}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "caches", "namespace": namespace},
         "rules": [{"apiGroups": ["serving.kserve.io"], "resources": ["localmodelnamespacecaches", "inferenceservices"],
                    "verbs": ["*"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "caches", "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "caches"},
         "subjects": [{"kind": "ServiceAccount", "name": "user", "namespace": namespace}]},
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    return cluster.kubeconfig_for(namespace, "user")


def as_tenant(cluster: Cluster, kubeconfig: Path, *args: str, stdin: Any = None) -> Any:
    """kubectl as the tenant's user (``stdin``: an object or a list of them, as YAML)."""
    text = None if stdin is None else yaml.safe_dump_all(stdin if isinstance(stdin, list) else [stdin])
    return cluster.kubectl(*args, kubeconfig=kubeconfig, input=text, check=False)


@dataclass
class Origin:
    """Every request it got: method, path, headers."""

    port: int
    requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def seen(self, text: str) -> bool:
        return text in json.dumps(self.requests)


@contextmanager
def recording_origin() -> Iterator[Origin]:
    """An HTTP origin on loopback that records each request and answers 403 (the review's fake_origin.py)."""
    origin = Origin(0)

    class Handler(BaseHTTPRequestHandler):
        def _record(self) -> None:
            origin.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers)})
            body = b"<Error><Code>AccessDenied</Code></Error>"
            self.send_response(403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_POST = _record

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    origin.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield origin
    finally:
        server.shutdown()
        server.server_close()
