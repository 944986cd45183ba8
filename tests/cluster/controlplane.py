"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, built from upstream modules (tests/cluster/build.py) and started as processes.

- The API server serves its secure port only, authenticates client certificates and
  service-account tokens (TokenRequest works), authorizes with Node,RBAC, and runs the
  admission plugins a real cluster enables by default plus NodeRestriction (what kubeadm adds).
  It reaches kubelets (logs, exec, port-forward) at their InternalIP with the admin's certificate.
- The controller manager runs every default controller with per-controller service-account
  credentials. Without real nodes (`node_address=None`) the node lifecycle controller is off: no
  Node would ever renew its Lease, and that controller would mark every Node unreachable after its
  grace period and evict what is bound there; Nodes are objects whose Ready condition the tests set
  directly (see `register_node`). With real nodes (tests/cluster/realnodes.py) it runs, as in any
  cluster: it lifts a new Node's not-ready taint and marks a Node whose kubelet stopped NotReady.
  Garbage collection, namespace deletion, the PV binder, service-account and root-CA publishing,
  pod GC all run as in any cluster.
- The scheduler binds pods to Nodes as it would in any cluster; on API-only Nodes they stay
  Pending (nothing runs them), on real nodes their kubelet runs them.
- With real nodes the API server also listens on the nodes' link (`node_address`, where pods and
  kubelets reach it) and publishes that address as the `kubernetes` Service's endpoint.

Every child process gets PR_SET_PDEATHSIG, so nothing outlives the Python process that started
it, even when that one is killed.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster.build import ensure_binaries
from tests.cluster.pki import PKI, make_pki

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CIDR = "10.96.0.0/16"
#: Without real nodes the node lifecycle controller is off (see the module docstring).
CONTROLLERS = "*,-node-lifecycle-controller"
#: With real nodes: a stopped kubelet's Node turns NotReady after this (the default is 50 s).
NODE_GRACE = "20s"
#: Label of the pods that stand in for a component the tests run as a process (``stand_in_pod``).
STAND_IN_LABEL = "modelcache.test/stand-in"


#: ServiceAccount kubeconfig files (``ControlPlane.kubeconfig_for``) -> how to make one bound to a node.
_ON_NODE: dict[str, Callable[[str], Path]] = {}


def on_node(kubeconfig: Path, node: str) -> Path:
    """The kubeconfig a component on ``node`` has: for a ServiceAccount's (``kubeconfig_for``),
    one whose token is bound to a pod on that node, as a DaemonSet pod's is; others unchanged."""
    make = _ON_NODE.get(str(kubeconfig))
    return make(node) if make is not None else kubeconfig


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (no orphaned servers)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] | None = field(default=None, repr=False)  # None: this process's environment
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    #: Run in the child before exec, after PR_SET_PDEATHSIG (enter a network namespace, join cgroups).
    setup: Callable[[], None] | None = field(default=None, repr=False)

    def start(self) -> Proc:
        def before_exec() -> None:
            _die_with_parent()
            if self.setup is not None:
                self.setup()

        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=self.env, preexec_fn=before_exec)
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 15) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def kubeconfig_text(server: str, ca: Path, user: dict[str, str], namespace: str = "default") -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "modelcache-test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "modelcache-test",
                      "context": {"cluster": "modelcache-test", "user": "user", "namespace": namespace}}],
        "current-context": "modelcache-test",
    }, indent=2)


class ControlPlane:
    """One control plane in ``workdir``; `start()` returns when /readyz answers ok."""

    def __init__(self, workdir: Path, bin_dir: Path | None = None, node_address: str | None = None,
                 proc_setup: Callable[[], None] | None = None, apiserver_args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.bin_dir = bin_dir
        self.node_address = node_address  # where real nodes reach the API server (None: no real nodes)
        self.proc_setup = proc_setup  # Proc.setup of every process (real nodes: join the run's cgroup tree)
        #: More kube-apiserver flags (e.g. --admission-control-config-file), after ours.
        self.apiserver_args = apiserver_args
        self.procs: dict[str, Proc] = {}
        self.pki: PKI | None = None
        self.etcd_port = self.etcd_peer_port = self.api_port = 0
        self.ready_seconds = 0.0

    # ---- addresses and credentials -----------------------------------------------------------

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    @property
    def kubeconfig(self) -> Path:
        """The admin's kubeconfig (client certificate in system:masters)."""
        return self.workdir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        assert self.pki is not None
        return self.pki.ca

    def _client_kubeconfig(self, name: str) -> Path:
        assert self.pki is not None
        pair = self.pki.clients[name]
        path = self.workdir / ("kubeconfig" if name == "admin" else f"{name}.kubeconfig")
        path.write_text(kubeconfig_text(self.server, self.pki.ca,
                                        {"client-certificate": str(pair.cert), "client-key": str(pair.key)}))
        path.chmod(0o600)
        return path

    def ssl_context(self, client: str = "admin") -> ssl.SSLContext:
        assert self.pki is not None
        ctx = ssl.create_default_context(cafile=str(self.pki.ca))
        pair = self.pki.clients[client]
        ctx.load_cert_chain(str(pair.cert), str(pair.key))
        return ctx

    def raw(self, path: str, method: str = "GET", body: Any = None, timeout: float = 10) -> tuple[int, str]:
        """One request as the admin, for readiness and for what the client library hides."""
        data = None if body is None else json.dumps(body).encode()
        kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
        deadline = time.monotonic() + 120  # a loaded 2-core machine can take a minute to fill a watch cache
        while True:
            req = urllib.request.Request(self.server + path, data=data, method=method,
                                         headers={"Content-Type": kind} if data else {})
            try:
                with urllib.request.urlopen(req, timeout=timeout, context=self.ssl_context()) as resp:
                    return resp.status, resp.read().decode()
            except urllib.error.HTTPError as exc:
                text = exc.read().decode(errors="replace")
                # Right after a (re)start each kind's watch cache answers 429 "storage is
                # (re)initializing" with a Retry-After until it has listed etcd.
                if exc.code != 429 or time.monotonic() > deadline:
                    return exc.code, text
                time.sleep(float(exc.headers.get("Retry-After") or 1))

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> ControlPlane:
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.bin_dir = ensure_binaries() if self.bin_dir is None else self.bin_dir
        self.pki = make_pki(self.workdir / "pki", [self.node_address] if self.node_address else [])
        self.etcd_port, self.etcd_peer_port, self.api_port = free_port(), free_port(), free_port()
        try:
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            self._start_controllers()
        except BaseException:
            self.stop()
            raise
        self.ready_seconds = time.monotonic() - started
        return self

    def stop(self) -> None:
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _bin(self, name: str) -> str:
        assert self.bin_dir is not None
        return str(self.bin_dir / name)

    def _spawn(self, name: str, args: list[str]) -> Proc:
        proc = Proc(name, [self._bin(name), *args], self.workdir / f"{name}.log", setup=self.proc_setup).start()
        self.procs[name] = proc
        return proc

    def _wait(self, proc: Proc, check: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during start-up; its log ends:\n{proc.log_tail()}")
            try:
                if check():
                    return
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.1)
        raise RuntimeError(f"{proc.name} not ready after {timeout:.0f} s (last error: {last}); its log ends:\n"
                           f"{proc.log_tail()}")

    def _start_etcd(self, timeout: float) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        proc = self._spawn("etcd", [
            "--name", "default", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}", "--log-level", "warn",
            # A test cluster's data is thrown away: skip fsync (it would dominate on a shared disk).
            "--unsafe-no-fsync",
        ])

        self._wait(proc, self._etcd_healthy, timeout)

    def _etcd_healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=1) as resp:
            return bool(json.loads(resp.read()).get("health") == "true")

    def _apiserver_args(self) -> list[str]:
        assert self.pki is not None
        if self.node_address:
            # Loopback for the tests, the nodes' link for kubelets and pods (whose kube-proxy sends
            # the `kubernetes` Service to the endpoint published here).
            where = ["--bind-address", "0.0.0.0", "--advertise-address", self.node_address,
                     "--endpoint-reconciler-type", "lease"]
        else:
            # No kube-proxy routes the `kubernetes` Service here; do not publish loopback endpoints.
            where = ["--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
                     "--endpoint-reconciler-type", "none"]
        return [
            "--etcd-servers", self.etcd_url, "--secure-port", str(self.api_port), *where,
            # Logs, exec, port-forward: the kubelet is reached at its InternalIP (there is no DNS for
            # Node names) and authenticates the API server by the admin's client certificate.
            "--kubelet-client-certificate", str(self.pki.clients["admin"].cert),
            "--kubelet-client-key", str(self.pki.clients["admin"].key),
            "--kubelet-preferred-address-types", "InternalIP,Hostname",
            "--tls-cert-file", str(self.pki.server.cert), "--tls-private-key-file", str(self.pki.server.key),
            "--client-ca-file", str(self.pki.ca),
            "--service-account-issuer", SERVICE_ACCOUNT_ISSUER,
            "--service-account-key-file", str(self.pki.sa_public),
            "--service-account-signing-key-file", str(self.pki.sa_private),
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--authorization-mode", "Node,RBAC",
            "--enable-admission-plugins", "NodeRestriction",
            "--allow-privileged=true",
            # Webhooks and aggregated APIs given as a Service go to its endpoints, not its ClusterIP
            # (no kube-proxy here).
            "--enable-aggregator-routing=true",
            "--profiling=false",
            *self.apiserver_args,
        ]

    def _start_apiserver(self, timeout: float) -> None:
        proc = self._spawn("kube-apiserver", self._apiserver_args())
        self._wait(proc, lambda: self.raw("/readyz", timeout=2)[0] == 200, timeout)
        self._client_kubeconfig("admin")

    def _start_controllers(self) -> None:
        assert self.pki is not None
        cm = str(self._client_kubeconfig("controller-manager"))
        self._spawn("kube-controller-manager", [
            "--kubeconfig", cm, "--authentication-kubeconfig", cm, "--authorization-kubeconfig", cm,
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--leader-elect=false", "--use-service-account-credentials=true",
            "--service-account-private-key-file", str(self.pki.sa_private),
            "--root-ca-file", str(self.pki.ca),
            "--cluster-signing-cert-file", str(self.pki.server.cert),
            "--cluster-signing-key-file", str(self.pki.server.key),
            *(["--controllers", "*", "--node-monitor-grace-period", NODE_GRACE, "--node-monitor-period", "2s"]
              if self.node_address else ["--controllers", CONTROLLERS]),
        ])
        sched = str(self._client_kubeconfig("scheduler"))
        self._spawn("kube-scheduler", [
            "--kubeconfig", sched, "--authentication-kubeconfig", sched, "--authorization-kubeconfig", sched,
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()), "--leader-elect=false",
        ])

    def restart_apiserver(self, timeout: float = 120, between: Any = None) -> None:
        """Stop the API server (every watch and connection drops), run ``between()``, start it again
        on the same port and wait until it is ready."""
        proc = self.procs["kube-apiserver"]
        proc.stop()
        if between is not None:
            between()
        proc.start()
        self._wait(proc, lambda: self.raw("/readyz", timeout=2)[0] == 200, timeout)

    # ---- etcd --------------------------------------------------------------------------------

    def _etcd(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.etcd_url}{path}", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return dict(json.loads(resp.read()))

    def _restart_etcd(self, meanwhile: Any, timeout: float = 60) -> None:
        etcd = self.procs["etcd"]
        etcd.stop()
        meanwhile()
        etcd.start()
        self._wait(etcd, self._etcd_healthy, timeout)

    def backup_etcd(self) -> Path:
        """An operator's backup: a copy of etcd's data taken while it (and the API server) is
        stopped for a moment."""
        dest = self.workdir / f"etcd-backup-{time.monotonic_ns()}"
        self.restart_apiserver(between=lambda: self._restart_etcd(
            lambda: shutil.copytree(self.workdir / "etcd", dest)))
        return dest

    def restore_etcd(self, backup: Path) -> None:
        """An etcd restore: the data goes back to ``backup`` and the API server starts on it. Every
        resourceVersion written since is gone, and those clients hold lie in the server's future."""
        data = self.workdir / "etcd"

        def swap() -> None:
            shutil.rmtree(data)
            shutil.copytree(backup, data)

        self.restart_apiserver(between=lambda: self._restart_etcd(swap))

    def etcd_revision(self) -> int:
        everything = base64.b64encode(b"\0").decode()
        answer = self._etcd("/v3/kv/range", {"key": everything, "range_end": everything, "count_only": True})
        return int(answer["header"]["revision"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now (what the API server does every 5 minutes): every
        older resourceVersion is gone from etcd."""
        revision = self.etcd_revision()
        self._etcd("/v3/kv/compaction", {"revision": revision, "physical": True})
        return revision

    # ---- helpers every user of a cluster needs ----------------------------------------------------

    def kubectl(self, *args: str, kubeconfig: Path | None = None, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = [self._bin("kubectl"), "--kubeconfig", str(kubeconfig or self.kubeconfig),
               "--cache-dir", str(self.workdir / "kubectl-cache"), *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def token(self, namespace: str, service_account: str, seconds: int = 3600,
              audiences: list[str] | None = None, pod: dict[str, Any] | None = None) -> str:
        """A bound token for the ServiceAccount (TokenRequest), as the kubelet projects one into pods
        (for ``audiences``, as a projected ``serviceAccountToken`` volume with an ``audience``;
        with ``pod``, bound to it and so to its node, as the kubelet's are)."""
        spec: dict[str, Any] = {"expirationSeconds": seconds}
        if audiences:
            spec["audiences"] = audiences
        if pod is not None:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                      "uid": pod["metadata"]["uid"]}
        status, body = self.raw(f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
                                method="POST", body={"apiVersion": "authentication.k8s.io/v1",
                                                     "kind": "TokenRequest", "spec": spec})
        if status != 201:
            raise RuntimeError(f"TokenRequest for {namespace}/{service_account} answered {status}: {body}")
        return str(json.loads(body)["status"]["token"])

    def kubeconfig_for(self, namespace: str, service_account: str, seconds: int = 3600) -> Path:
        """A kubeconfig that authenticates as the ServiceAccount with a fresh bound token (bound to
        no pod); ``on_node(path, node)``: one whose token is bound to a pod on that Node, as a
        DaemonSet's pod has (tests.agent_util.start_agent asks for it)."""
        path = self.workdir / "sa" / f"{namespace}.{service_account}.kubeconfig"
        path.parent.mkdir(exist_ok=True)
        path.write_text(kubeconfig_text(self.server, self.ca_file,
                                        {"token": self.token(namespace, service_account, seconds)}, namespace))
        path.chmod(0o600)
        _ON_NODE[str(path)] = lambda node: self.kubeconfig_on_node(namespace, service_account, node, seconds)
        return path

    def kubeconfig_on_node(self, namespace: str, service_account: str, node: str, seconds: int = 3600) -> Path:
        """A kubeconfig for the ServiceAccount whose token is bound to a pod on ``node``."""
        path = self.workdir / "sa" / f"{namespace}.{service_account}.{node}.kubeconfig"
        path.parent.mkdir(exist_ok=True)
        token = self.token(namespace, service_account, seconds, pod=self.stand_in_pod(namespace, service_account, node))
        path.write_text(kubeconfig_text(self.server, self.ca_file, {"token": token}, namespace))
        path.chmod(0o600)
        return path

    def stand_in_pod(self, namespace: str, service_account: str, node: str) -> dict[str, Any]:
        """A pod of the ServiceAccount bound to ``node``, whose token then carries the node as a
        DaemonSet pod's does (``authentication.kubernetes.io/node-name`` in the user's extra),
        for a component the tests run as a process. It never runs: with no kubelet nothing would,
        and a real kubelet refuses it at admission (its nodeSelector matches no node). A pod made
        before is used again, whether or not its Node is there now (a test may have deleted the
        Node for a while: registering it here, with none of that test's labels, raced the test's
        own registration; tests/test_chaos.py hung on it). A new pod's Node is registered if
        missing: the pod GC deletes pods of unknown nodes after 40 s, and with the pod every
        token bound to it."""
        name = f"{service_account}-on-{node}"
        path = f"/api/v1/namespaces/{namespace}/pods"
        status, text = self.raw(f"{path}/{name}")
        if status == 200:
            return dict(json.loads(text))
        status, _ = self.raw(f"/api/v1/nodes/{node}")
        if status == 404:
            self.register_node(node)
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace,
                                                                "labels": {STAND_IN_LABEL: "true"}},
                "spec": {"nodeName": node, "serviceAccountName": service_account,
                         "automountServiceAccountToken": False, "nodeSelector": {STAND_IN_LABEL: "never"},
                         "containers": [{"name": "stand-in", "image": "localhost/modelcache-stand-in:never"}]}}
        status, text = self.raw(path, "POST", body)
        if status == 409:
            status, text = self.raw(f"{path}/{name}")
        if status not in (200, 201):
            raise RuntimeError(f"creating the stand-in pod {namespace}/{name} answered {status}: {text}")
        return dict(json.loads(text))

    def register_node(self, name: str, labels: dict[str, str] | None = None, ready: bool = True,
                      taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
        """A Node as a kubelet would register it: Ready, with capacity and the standard labels.

        The TaintNodesByCondition admission plugin taints every new Node not-ready; the node
        lifecycle controller (off here) would lift it once the Node is Ready, so this does."""
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            **(labels or {})}}}
        status, text = self.raw("/api/v1/nodes", "POST", body)
        if status == 409:  # registered already (a stand-in pod's node): these labels, as if new
            status, text = self.raw(f"/api/v1/nodes/{name}", "PATCH",
                                    {"metadata": {"labels": body["metadata"]["labels"]}})
        if status not in (200, 201):
            raise RuntimeError(f"creating Node {name} answered {status}: {text}")
        status, text = self.raw(f"/api/v1/nodes/{name}", "PATCH", {"spec": {"taints": taints or None}})
        if status != 200:
            raise RuntimeError(f"lifting the not-ready taint of Node {name} answered {status}: {text}")
        self.set_node_status(name, ready)
        status, text = self.raw(f"/api/v1/nodes/{name}")
        return dict(json.loads(text))

    def set_node_status(self, name: str, ready: bool) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        resources = {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"}
        condition = {"type": "Ready", "status": "True" if ready else "False",
                     "reason": "KubeletReady" if ready else "KubeletNotReady",
                     "message": "simulated node" if ready else "simulated node is not ready",
                     "lastHeartbeatTime": now, "lastTransitionTime": now}
        body = {"status": {"capacity": resources, "allocatable": resources, "conditions": [condition],
                           "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                         {"type": "Hostname", "address": name}]}}
        req = urllib.request.Request(f"{self.server}/api/v1/nodes/{name}/status", data=json.dumps(body).encode(),
                                     method="PATCH", headers={"Content-Type": "application/strategic-merge-patch+json"})
        with urllib.request.urlopen(req, timeout=10, context=self.ssl_context()):
            pass

    def server_version(self) -> dict[str, Any]:
        return dict(json.loads(self.raw("/version")[1]))


@contextlib.contextmanager
def running(workdir: Path, nodes: int = 0) -> Any:
    cp = ControlPlane(workdir).start()
    try:
        for i in range(nodes):
            cp.register_node(f"node-{i + 1}")
        yield cp
    finally:
        cp.stop()
