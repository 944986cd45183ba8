"""Start-up failures of modelcache-agent and modelcache-coordinator: one line naming the problem
and the flag that fixes it, exit code 2, never a traceback. Each process runs for real, forked
with the product imported (tests/forked.py: ~2 CPU-s of imports a run saved)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import forked
from tests.agent_util import write_node
from tests.helpers import REPO, mounted_tmpfs

pytestmark = pytest.mark.timeout(120)


def run(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    full["HOME"] = "/nonexistent-home"  # no ~/.kube/config of the machine's user
    full.update(env or {})
    return forked.run_module(module, *args, cwd=REPO, timeout=timeout, env=full)


def the_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    assert not [ln for ln in proc.stderr.splitlines() if ln.startswith((" ", "\t"))], proc.stderr  # no frames
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.fixture()
def spec(tmp_path: Path) -> Path:
    return write_node(tmp_path / "node.yaml", [])


@pytest.fixture()
def kubeconfig(tmp_path: Path) -> Path:
    """Well-formed, pointing at a port nothing listens on (start-up fails before any request)."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\nusers: [{name: u, user: {}}]\n")
    return path


def test_agent_port_taken(spec: Path, tmp_path: Path) -> None:
    with taken_port() as port:
        proc = run("agent", "--standalone", str(spec), "--root", str(tmp_path / "root"),
                   "--host", "127.0.0.1", "--port", str(port))
    the_error(proc, f"127.0.0.1:{port}", "already in use", "--port")


def test_agent_peers_on_without_a_token_is_one_line(kubeconfig: Path, tmp_path: Path) -> None:
    proc = run("agent", "--node", "n1", "--port", "-1", "--root", str(tmp_path / "root"), "--kubeconfig",
               str(kubeconfig), "--peers", "on", "--peer-token-file", str(tmp_path / "no-token"))
    the_error(proc, f"--peer-token-file: {tmp_path / 'no-token'} does not exist", "modelcache-peer", "--peers=off")


def test_agent_peer_port_taken(kubeconfig: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    with taken_port() as port:
        proc = run("agent", "--node", "n1", "--port", "-1", "--root", str(tmp_path / "root"), "--kubeconfig",
                   str(kubeconfig), "--peers", "on", "--peer-token-file", str(token), "--peer-host", "127.0.0.1",
                   "--peer-port", str(port), "--peer-address", "127.0.0.1")
    the_error(proc, f"127.0.0.1:{port}", "already in use", "--peer-port")


def test_coordinator_port_taken(kubeconfig: Path) -> None:
    with taken_port() as port:
        proc = run("coordinator", "--kubeconfig", str(kubeconfig), "--bind", "127.0.0.1", "--port", str(port))
    the_error(proc, f"127.0.0.1:{port}", "already in use", "--port")


def test_coordinator_webhook_port_taken(kubeconfig: Path, tmp_path: Path) -> None:
    with taken_port() as port, taken_port() as _:
        proc = run("coordinator", "--kubeconfig", str(kubeconfig), "--bind", "127.0.0.1", "--port", "0",
                   "--webhook-cert-dir", str(tmp_path / "certs"), "--self-signed", "--webhook-port", str(port))
    the_error(proc, f"127.0.0.1:{port}", "already in use", "--webhook-port")


@pytest.mark.parametrize(("module", "case"), [("agent", "missing"), ("agent", "garbage"), ("agent", "directory"),
                                             ("coordinator", "missing"), ("coordinator", "not-a-config")])
def test_unreadable_kubeconfig(tmp_path: Path, module: str, case: str) -> None:
    path = tmp_path / "kc"
    if case == "directory":
        path.mkdir()
    elif case == "garbage":
        path.write_text("clusters: [\n")
    elif case == "not-a-config":
        path.write_text("just: text\n")
    args = ["--node", "n1", "--port", "-1", "--root", str(tmp_path / "root")] if module == "agent" else ["--port", "0"]
    proc = run(module, "--kubeconfig", str(path), *args)
    the_error(proc, f"--kubeconfig {path}", "--kubeconfig (or KUBECONFIG)")


@pytest.mark.parametrize("module", ["agent", "agent-with-peers", "coordinator"])
def test_a_kubeconfig_whose_server_is_not_there_is_one_line(kubeconfig: Path, tmp_path: Path, module: str) -> None:
    # Was a traceback: the coordinator's first list raised MaxRetryError, the agent's informers
    # retried for a minute and ended in a TimeoutError (with peers on, its first TokenReview).
    args = ["--node", "n1", "--root", str(tmp_path / "root")] if module != "coordinator" else []
    if module == "agent-with-peers":
        (tmp_path / "token").write_text("t")
        args += ["--peers", "on", "--peer-token-file", str(tmp_path / "token"), "--peer-host", "127.0.0.1",
                 "--peer-port", "0", "--peer-address", "127.0.0.1"]
        module = "agent"  # (its zone lookup logs urllib3's retries first: warnings, not the error)
    proc = run(module, "--kubeconfig", str(kubeconfig), "--port", "0", *args)
    the_error(proc, f"--kubeconfig {kubeconfig}: cannot reach the API server http://127.0.0.1:9 (connection refused)",
              "check the server address")
    assert "Retrying" not in proc.stderr or "--peers" in args


@pytest.mark.parametrize("module", ["agent", "coordinator"])
def test_a_kubeconfig_whose_token_the_server_refuses_is_one_line(cluster, tmp_path: Path, module: str) -> None:
    import yaml

    doc = yaml.safe_load(cluster.agent_kubeconfig.read_text())
    for user in doc["users"]:
        user["user"] = {"token": "not-a-token"}
    bad = tmp_path / "kc"
    bad.write_text(yaml.safe_dump(doc))
    args = ["--node", "n1", "--root", str(tmp_path / "root")] if module == "agent" else []
    proc = run(module, "--kubeconfig", str(bad), "--port", "0", *args)
    the_error(proc, f"--kubeconfig {bad}: the API server {cluster.server} refused its credentials (401 Unauthorized")
    assert "not-a-token" not in proc.stderr


@pytest.mark.timeout(200)
def test_an_agent_that_may_not_list_its_crds_says_so_in_one_line(cluster, tmp_path: Path) -> None:
    from modelcache.kube.client import SERVICE_ACCOUNTS

    # A ServiceAccount with no grants: the API server answers, RBAC refuses every list.
    cluster.kube().create(SERVICE_ACCOUNTS, {"metadata": {"name": "nobody"}}, "default")
    kc = cluster.kubeconfig_for("default", "nobody")
    proc = run("agent", "--kubeconfig", str(kc), "--node", "n1", "--root", str(tmp_path / "root"), "--port", "-1",
               timeout=150)  # the agent gives the API server a minute
    the_error(proc, "error: could not list ", " from the API server within 60 s (last error: HTTP 403: ",
              'is forbidden: User "system:serviceaccount:default:nobody" cannot ',
              "check the agent's RBAC (deploy/rbac/agent.yaml)")


@pytest.mark.parametrize("module", ["agent", "coordinator"])
def test_no_kubeconfig_at_all_names_the_flag(tmp_path: Path, module: str) -> None:
    args = ["--node", "n1", "--port", "-1", "--root", str(tmp_path / "root")] if module == "agent" else ["--port", "0"]
    proc = run(module, *args)
    the_error(proc, "no cluster to talk to", "--kubeconfig")


@pytest.mark.parametrize(
    ("module", "flag", "value", "needle"),
    [
        ("agent", "--port", "99999", "'--port'"),
        ("agent", "--port", "http", "'--port'"),
        ("agent", "--workers", "0", "'--workers'"),
        ("agent", "--chunk-size", "lots", "'--chunk-size'"),
        ("agent", "--chunk-size", "1", "1 B is outside the allowed range 64.0 KiB to 1.0 GiB"),
        ("agent", "--chunk-size", "100Gi", "100.0 GiB is outside the allowed range"),
        ("agent", "--log-level", "loud", "'--log-level'"),
        ("agent", "--resync-period", "-1", "'--resync-period'"),
        ("agent", "--download-env", "NOEQUALS", "'--download-env'"),
        ("agent", "--peers", "maybe", "'--peers'"),
        ("agent", "--peer-upload-rate", "fast", "'--peer-upload-rate'"),
        ("agent", "--peer-max-uploads", "0", "'--peer-max-uploads'"),
        ("coordinator", "--port", "70000", "'--port'"),
        ("coordinator", "--webhook-port", "-5", "'--webhook-port'"),
        ("coordinator", "--workers", "0", "'--workers'"),
        ("coordinator", "--log-level", "loud", "'--log-level'"),
        ("coordinator", "--discovery-interval", "soon", "'--discovery-interval'"),
        ("coordinator", "--pod-rewrite", "maybe", "'--pod-rewrite'"),
    ],
)
def test_bad_flag_values(spec: Path, tmp_path: Path, module: str, flag: str, value: str, needle: str) -> None:
    base = ["--standalone", str(spec), "--root", str(tmp_path / "root")] if module == "agent" else []
    proc = run(module, *base, flag, value)
    the_error(proc, needle, "--help")
    assert "Usage:" not in proc.stderr, proc.stderr


def test_agent_buffers_beyond_the_memory_left_are_one_line(spec: Path, tmp_path: Path) -> None:
    from modelcache.engine.resources import available_memory

    have = available_memory()
    assert have is not None and have < 3 * 384 << 30  # 256 workers x 1 GiB chunks x 2 models do not fit
    proc = run("agent", "--standalone", str(spec), "--root", str(tmp_path / "root"), "--workers", "256",
               "--chunk-size", "1Gi", "--port", "-1")
    the_error(proc, "--workers 256 x --chunk-size 1.0 GiB x 2 models at once needs 768.0 GiB of transfer buffers",
              "(or --max-concurrent-models)")
    assert not (tmp_path / "root").exists()


def test_agent_needs_a_node_name_outside_standalone(tmp_path: Path) -> None:
    the_error(run("agent", "--root", str(tmp_path / "root")), "--node")


@pytest.mark.parametrize("content", ["kind: Pod\n", "", "---\n", "- a\n- b\n"])
def test_agent_spec_file_that_is_not_a_local_model_node(tmp_path: Path, content: str) -> None:
    bad = tmp_path / "node.yaml"
    bad.write_text(content)
    proc = run("agent", "--standalone", str(bad), "--root", str(tmp_path / "root"), "--port", "-1")
    the_error(proc, "--standalone", str(bad), "LocalModelNode")


@pytest.mark.parametrize("case", ["missing", "key-missing", "garbage"])
def test_coordinator_webhook_certificate_problems(kubeconfig: Path, tmp_path: Path, case: str) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    if case == "key-missing":
        (certs / "tls.crt").write_text("x")
    elif case == "garbage":
        (certs / "tls.crt").write_text("-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
        (certs / "tls.key").write_text("nope")
    proc = run("coordinator", "--kubeconfig", str(kubeconfig), "--bind", "127.0.0.1", "--port", "0",
               "--webhook-port", "0", "--webhook-cert-dir", str(certs))
    want = {"missing": "tls.crt not found", "key-missing": "tls.key not found", "garbage": "cannot load"}[case]
    the_error(proc, f"--webhook-cert-dir {certs}", want)


def test_agent_read_only_root_is_reported_at_start(spec: Path, tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "size=4m,ro") as mnt:
        proc = run("agent", "--standalone", str(spec), "--root", str(mnt), "--port", "-1")
        the_error(proc, f"--root {mnt}", "read-only", "point --root at a writable directory")
        assert not (spec.with_name(spec.name + ".status.yaml")).exists()


def test_an_api_server_that_comes_up_late_is_waited_for_within_the_patience(tmp_path: Path) -> None:
    """In a pod the agent waits up to a minute for an API server it cannot reach yet (a starting
    node); with no patience (a kubeconfig given by hand) it says so at once."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kubernetes import client

    from modelcache.kube.client import KubeConfigError, check_api_server
    from tests.helpers import free_port

    class Version(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"major": "1", "minor": "37", "gitVersion": "v1.37.2"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    port = free_port()
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    api = client.ApiClient(cfg)
    with pytest.raises(KubeConfigError, match=rf"^src: cannot reach the API server http://127.0.0.1:{port} "
                                              r"\(connection refused\); check the server address"):
        check_api_server(api, "src")
    server = ThreadingHTTPServer(("127.0.0.1", port), Version)
    started = threading.Timer(3.0, server.serve_forever)  # comes up after the first tries failed
    started.start()
    try:
        assert check_api_server(api, "src", patience=60.0) is True
    finally:
        server.shutdown()
        server.server_close()
    stop = threading.Event()
    stop.set()
    assert check_api_server(api, "src", patience=60.0, stop=stop) is False  # SIGTERM while waiting
