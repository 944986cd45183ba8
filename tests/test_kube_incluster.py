"""In-cluster configuration (modelcache/kube/client.py) against a real HTTPS server: the pod's
service-account token, CA and namespace, as the kubelet mounts them, and the one-line errors when
they are missing. The same path runs inside the image in tests/test_image_agent.py."""

from __future__ import annotations

import datetime
import json
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from modelcache.kube import client as kube_client
from modelcache.kube.client import NAMESPACES, Kube, KubeConfigError, in_cluster_api_client, in_cluster_namespace
from tests.helpers import REPO, self_trusting_pair


@dataclass
class FakeAPIServer:
    """An HTTPS server that answers the namespace list only to ``Bearer <token>``."""

    port: int
    ca: Path
    token: str = ""
    seen: list[str] = field(default_factory=list)


@pytest.fixture
def apiserver(tmp_path: Path) -> Iterator[FakeAPIServer]:
    cert, key = self_trusting_pair(tmp_path / "server", "localhost", "127.0.0.1")
    state = FakeAPIServer(0, cert)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            auth = self.headers.get("Authorization", "")
            state.seen.append(auth)
            ok = auth == f"Bearer {state.token}" and self.path.startswith("/api/v1/namespaces")
            body = (
                {"kind": "NamespaceList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                 "items": [{"metadata": {"name": "modelcache-system"}}]}
                if ok else
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Unauthorized", "code": 401,
                 "message": "Unauthorized"}
            )
            data = json.dumps(body).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def mount_service_account(sa_dir: Path, token: str, ca: Path, namespace: str = "modelcache-system") -> Path:
    """The files the kubelet puts at /var/run/secrets/kubernetes.io/serviceaccount."""
    sa_dir.mkdir(parents=True, exist_ok=True)
    (sa_dir / "token").write_text(token)
    (sa_dir / "ca.crt").write_bytes(ca.read_bytes())
    (sa_dir / "namespace").write_text(namespace)
    return sa_dir


def pod_env(port: int) -> dict[str, str]:
    return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)}


def names(kube: Kube) -> list[str]:
    return [n["metadata"]["name"] for n in kube.list(NAMESPACES)["items"]]


def test_service_account_token_and_ca_reach_the_api_server(apiserver: FakeAPIServer, tmp_path: Path) -> None:
    apiserver.token = "sa-token-1"
    # A trailing newline, as in a token file written by hand: stripped (client-go does too), else
    # it would go into the Authorization header and every request would fail.
    sa = mount_service_account(tmp_path / "sa", "sa-token-1\n", apiserver.ca)
    kube = Kube(in_cluster_api_client(sa, pod_env(apiserver.port)))
    assert kube.api_client.configuration.host == f"https://127.0.0.1:{apiserver.port}"
    assert names(kube) == ["modelcache-system"]
    assert apiserver.seen == ["Bearer sa-token-1"]
    assert in_cluster_namespace(sa) == "modelcache-system"


def test_rotated_token_is_read_again(apiserver: FakeAPIServer, tmp_path: Path) -> None:
    """Projected tokens are rotated in place by the kubelet; the client reads the file again."""
    apiserver.token = "first"
    sa = mount_service_account(tmp_path / "sa", "first", apiserver.ca)
    kube = Kube(in_cluster_api_client(sa, pod_env(apiserver.port), refresh=datetime.timedelta(0)))
    assert names(kube) == ["modelcache-system"]
    (sa / "token").write_text("second")
    apiserver.token = "second"
    assert names(kube) == ["modelcache-system"]
    assert apiserver.seen == ["Bearer first", "Bearer second"]


def test_an_untrusted_server_is_refused(apiserver: FakeAPIServer, tmp_path: Path) -> None:
    apiserver.token = "t"
    other_ca, _ = self_trusting_pair(tmp_path / "other", "127.0.0.1")
    sa = mount_service_account(tmp_path / "sa", "t", other_ca)
    kube = Kube(in_cluster_api_client(sa, pod_env(apiserver.port)))
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        names(kube)
    assert apiserver.seen == []  # the token never left the client


def test_load_api_client_uses_the_mounted_service_account_in_a_pod(
    apiserver: FakeAPIServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    apiserver.token = "pod-token"
    sa = mount_service_account(tmp_path / "sa", "pod-token", apiserver.ca)
    monkeypatch.setattr(kube_client, "SERVICE_ACCOUNT_DIR", sa)
    for k, v in pod_env(apiserver.port).items():
        monkeypatch.setenv(k, v)
    # A kubeconfig in the environment loses to the pod's own identity unless passed explicitly.
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent-kubeconfig"))
    assert names(Kube(kube_client.load_api_client())) == ["modelcache-system"]
    assert apiserver.seen == ["Bearer pod-token"]


def test_missing_token_in_a_pod_is_one_line_naming_the_file(tmp_path: Path) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "ca.crt").write_text("x")
    with pytest.raises(KubeConfigError) as err:
        in_cluster_api_client(sa, pod_env(6443))
    msg = str(err.value)
    assert "\n" not in msg
    assert str(sa / "token") in msg and "automountServiceAccountToken" in msg
    assert in_cluster_namespace(sa) is None


@pytest.mark.parametrize("module", ["agent", "coordinator"])
def test_processes_started_in_a_pod_without_a_token_exit_with_one_line(module: str) -> None:
    """The standard path /var/run/secrets/... does not exist on the test machine: exactly what a
    pod with automountServiceAccountToken: false sees."""
    if (kube_client.SERVICE_ACCOUNT_DIR / "token").exists():
        pytest.skip("this machine has a service account mounted")
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env.update(pod_env(6443), PYTHONPATH=str(REPO), NODE_NAME="node-a")
    proc = subprocess.run([sys.executable, "-m", module, "--port", "-1" if module == "agent" else "0"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2  # a start-up error (modelcache/runtime/startup.py)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: in-cluster config: {kube_client.SERVICE_ACCOUNT_DIR / 'token'} is missing or empty: run with the "
        "pod's service account token mounted (automountServiceAccountToken: true) or pass --kubeconfig"
    ], proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_configuration_outside_a_pod_is_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    env.update(PYTHONPATH=str(REPO), HOME=str(tmp_path), KUBECONFIG=str(tmp_path / "missing"), NODE_NAME="n")
    proc = subprocess.run([sys.executable, "-m", "agent", "--port", "-1"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --kubeconfig {tmp_path / 'missing'}: cannot read it"), proc.stderr
    assert "point --kubeconfig (or KUBECONFIG) at a readable kubeconfig file" in last
    assert "Traceback" not in proc.stderr
