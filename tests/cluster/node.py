"""One real Kubernetes node of the tests: a kubelet and a containerd of its own.

Both run inside the run's network namespace (tests/cluster/podnet.py) and its cgroup tree
(tests/cluster/cgroups.py); the kubelet puts its pods in a cgroup root of its own below it, so
two nodes on one machine never see each other's pods. Each node also has a mount namespace of its
own, a copy of the host's in which the node's own folders are bound over the host paths a node
owns: `/models` (deploy/'s hostPath for the model root: two agents on one machine must not share
it), and the paths the kubelet and libcni use whatever they are told (`/var/lib/kubelet`,
`/var/log/containers`, `/var/lib/cni`). A hostPath volume, a local PV and the kubelet's own mounts
are resolved and made there (the CLI's mount guard sees them through the kubelet's
/proc/<pid>/mountinfo), and they all go with the namespace. Per node:
- containerd: a private socket and state under the slot's run folder, and a root (content store,
  snapshots, the record of loaded images) kept between runs in `.work/cluster/nodes/slot-N/<node>`;
  CRI with runc (Debian's), the CNI bridge (Debian's plugins), our pause image pinned as the
  sandbox, and `restrict_oom_score_adj`: these VMs lack CAP_SYS_RESOURCE, so runc cannot give a
  sandbox the kubelet's oom_score_adj of -998 (every pod stayed ContainerCreating with "can't get
  final child's PID from pipe: EOF"); containerd clamps it to its own score. NRI is off (it would
  listen at a fixed path).
- kubelet: the control plane's release, a client certificate for `system:node:<name>` signed by the
  cluster CA, its root dir, pod log dir and volume plugin dir in the node's folder, its API on the
  node address at a port of its own, cgroup v1 allowed (`failCgroupV1: false`), no iptables chains
  of its own (`makeIPTablesUtilChains: false`: they exist for kube-proxy, which has its own
  namespace here), eviction thresholds that a shared disk does not trip, and images never
  garbage-collected (they cannot be pulled again).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from tests.cluster import cgroups, podnet
from tests.cluster.build import BIN, NODE_RUNTIME, REPO
from tests.cluster.controlplane import ControlPlane, Proc, kubeconfig_text
from tests.cluster.images import Archive, ImageStore
from tests.cluster.pki import issue_client
from tests.cluster.slot import Names

CACHE = REPO / ".work" / "cluster" / "nodes"
#: Host paths that are the node's own: bound, in the node's mount namespace, to <workdir>/host/<path>.
NODE_PATHS = ("/models", "/var/lib/kubelet", "/var/log/containers", "/var/lib/cni")
_CLONE_NEWNS = 0x00020000
#: The kubelet API's port of node i is KUBELET_PORT + 2 * i (its healthz the next one up).
KUBELET_PORT = 10250


def daemons_cgroup(names: Names) -> str:
    return f"{names.cgroup}/daemons"


def in_node(names: Names, mntns: Path | None = None) -> Any:
    """Proc.setup for the processes of the run's nodes: the network namespace, a node's mount
    namespace (containerd and the kubelet), the cgroup tree."""
    netns, tree = names.netns, daemons_cgroup(names)

    def setup() -> None:
        podnet.enter(netns)
        if mntns is not None:
            podnet.enter(mntns, _CLONE_NEWNS)
        cgroups.join(tree)

    return setup


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


class RealNode:
    """Node ``name`` (the ``index``-th real node of slot ``names``), its files in ``workdir``."""

    def __init__(self, name: str, index: int, names: Names, workdir: Path, cp: ControlPlane,
                 sandbox_image: str) -> None:
        self.name = name
        self.index = index
        self.names = names
        self.workdir = workdir
        self.cp = cp
        self.sandbox_image = sandbox_image
        self.run_dir = names.run_dir / name
        self.cache = CACHE / f"slot-{names.n}" / name
        self.containerd: Proc | None = None
        self.kubelet: Proc | None = None

    # ---- paths ---------------------------------------------------------------------------

    @property
    def mntns(self) -> Path:
        return self.run_dir / "mntns"

    def host_path(self, path: str) -> Path:
        """Where the node's ``path`` (one of NODE_PATHS, or below one) is on the host."""
        return self.workdir / "host" / path.strip("/")

    @property
    def socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def cgroup_root(self) -> str:
        return f"{self.names.cgroup}/{self.name}"

    @property
    def root_dir(self) -> Path:
        """The kubelet's --root-dir (pods' volumes; it bind-mounts it onto itself): a short path on
        disk, as it holds unix sockets."""
        return self.names.data_dir / self.name / "kubelet"

    @property
    def port(self) -> int:
        return KUBELET_PORT + 2 * self.index

    @property
    def ctr(self) -> list[str]:
        return [str(NODE_RUNTIME.bin_dir / "ctr"), "--address", str(self.socket), "--namespace", "k8s.io"]

    @property
    def images(self) -> ImageStore:
        return ImageStore(self.ctr, self.cache / "images.json")

    # ---- containerd ------------------------------------------------------------------------

    def _containerd_config(self) -> str:
        cri_runtime = 'plugins."io.containerd.cri.v1.runtime"'
        runc = shutil.which("runc") or "/usr/sbin/runc"
        return f"""version = 3
root = "{self.cache / 'containerd'}"
state = "{self.run_dir / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.erofs", "io.containerd.nri.v1.nri"]
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{self.run_dir / 'opt'}"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{self.sandbox_image}"
[{cri_runtime}]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_cdi = false
  [{cri_runtime}.containerd]
    default_runtime_name = "runc"
    [{cri_runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri_runtime}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{runc}"
  [{cri_runtime}.cni]
    bin_dirs = ["{podnet.CNI_BIN}"]
    conf_dir = "{self.workdir / 'cni'}"
"""

    def _make_mount_namespace(self) -> None:
        self.mntns.touch()
        _run("unshare", f"--mount={self.mntns}", "--propagation", "private", "true")
        for path in NODE_PATHS:
            own = self.host_path(path)
            own.mkdir(parents=True, exist_ok=True)
            os.chmod(own, 0o755)
            _run("nsenter", f"--mount={self.mntns}", "mount", "--bind", str(own), path)

    def start_runtime(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.mntns.exists():
            self._make_mount_namespace()
        (self.cache / "containerd").mkdir(parents=True, exist_ok=True)
        cni = self.workdir / "cni"
        cni.mkdir(exist_ok=True)
        (cni / "10-pods.conflist").write_text(json.dumps(
            podnet.cni_config(self.names, self.index, self.run_dir / "ipam"), indent=1))
        config = self.workdir / "containerd.toml"
        config.write_text(self._containerd_config())
        env = {"PATH": f"{NODE_RUNTIME.bin_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
        self.containerd = Proc(f"containerd-{self.name}", [str(NODE_RUNTIME.bin_dir / "containerd"), "--config",
                                                           str(config)],
                               self.workdir / "containerd.log", env=env, setup=in_node(self.names, self.mntns)).start()
        deadline = time.monotonic() + 60
        while subprocess.run([*self.ctr, "version"], capture_output=True).returncode != 0:
            if not self.containerd.alive():
                raise RuntimeError(f"containerd of {self.name} exited; its log ends:\n{self.containerd.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"containerd of {self.name} not answering after 60 s:\n{self.containerd.log_tail()}")
            time.sleep(0.1)
        self._forget_containers()

    def _forget_containers(self) -> None:
        """containerd's root is kept between runs for its images; the containers and sandboxes a
        killed run left in its database are not this run's (their processes were swept)."""
        for what in ("containers", "sandboxes"):
            ids = subprocess.run([*self.ctr, what, "ls", "-q"], capture_output=True, text=True).stdout.split()
            for chunk in range(0, len(ids), 50):
                subprocess.run([*self.ctr, what, "rm", *ids[chunk:chunk + 50]], capture_output=True)

    def load(self, archives: list[Archive]) -> list[str]:
        """Load the images; the references actually imported (the others were there)."""
        return [a.ref for a in archives if self.images.load(a)]

    # ---- kubelet ---------------------------------------------------------------------------

    def _kubelet_config(self) -> dict[str, Any]:
        assert self.cp.pki is not None
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": self.names.node_ip, "port": self.port,
            "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1", "healthzPort": self.port + 1,
            # No CAP_SYS_RESOURCE here: the kubelet cannot lower its own score either.
            "oomScoreAdj": 0,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.cp.pki.ca)}},
            "authorization": {"mode": "Webhook"},
            "clusterDomain": "cluster.local",
            "podLogsDir": str(self.workdir / "pod-logs"),
            "volumePluginDir": str(self.workdir / "volume-plugins"),
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "rotateCertificates": False,
            "makeIPTablesUtilChains": False,
            "serializeImagePulls": False,
            # A ConfigMap or projected token change reaches the pod within seconds, not a minute.
            "syncFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
        }

    def start_kubelet(self, labels: dict[str, str] | None = None) -> None:
        """Start the kubelet (again: its root dir and certificate are kept across restarts)."""
        assert self.cp.pki is not None
        pki = self.cp.pki.ca.parent
        if not (pki / f"node-{self.name}.crt").exists():
            issue_client(pki, f"node-{self.name}", f"system:node:{self.name}", "system:nodes")
        kubeconfig = self.workdir / "kubelet.kubeconfig"
        identity = {"client-certificate": str(pki / f"node-{self.name}.crt"),
                    "client-key": str(pki / f"node-{self.name}.key")}
        kubeconfig.write_text(kubeconfig_text(f"https://{self.names.host_ip}:{self.cp.api_port}", self.cp.pki.ca,
                                              identity))
        config = self.workdir / "kubelet.yaml"
        config.write_text(yaml.safe_dump(self._kubelet_config()))
        cgroups.make(self.cgroup_root)
        self.root_dir.mkdir(parents=True, exist_ok=True)
        args = ["--config", str(config), "--kubeconfig", str(kubeconfig), "--hostname-override", self.name,
                "--node-ip", self.names.node_ip, "--root-dir", str(self.root_dir),
                "--cert-dir", str(self.workdir / "kubelet-pki"), "--v", "2"]
        if labels:
            args += ["--node-labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        self.kubelet = Proc(f"kubelet-{self.name}", [str(BIN / "kubelet"), *args], self.workdir / "kubelet.log",
                            setup=in_node(self.names, self.mntns)).start()

    def stop_kubelet(self) -> None:
        """The kubelet only: its pods' containers keep running, as on any node."""
        if self.kubelet is not None:
            self.kubelet.stop()

    def ready(self) -> bool:
        status, body = self.cp.raw(f"/api/v1/nodes/{self.name}", timeout=5)
        if status != 200:
            return False
        node = json.loads(body)
        conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        taints = {t["key"] for t in node.get("spec", {}).get("taints") or []}
        return conditions.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            for proc in (self.containerd, self.kubelet):
                if proc is not None and not proc.alive():
                    raise RuntimeError(f"{proc.name} exited; its log ends:\n{proc.log_tail()}")
            if time.monotonic() > deadline:
                tail = self.kubelet.log_tail() if self.kubelet else ""
                raise RuntimeError(f"Node {self.name} not Ready after {timeout:.0f} s; the kubelet's log ends:\n{tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Kubelet, then containerd; what runs in the pods is ended with the run's cgroup tree."""
        self.stop_kubelet()
        if self.containerd is not None:
            self.containerd.stop()
