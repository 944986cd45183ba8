"""A control plane with real nodes: what `python -m tests.cluster up DIR --nodes N --kubelet K` and
the real-node fixtures start.

1. Claim a machine-wide slot (tests/cluster/slot.py), sweeping what a killed run left in it.
2. The run's network namespace, linked to the host (tests/cluster/podnet.py).
3. The control plane, also listening on the link, with the node lifecycle controller on.
4. K real nodes (tests/cluster/node.py): containerd with the images loaded, then the kubelet;
   `start()` returns when every one is Ready and its not-ready taint lifted.
5. kube-proxy (one for the namespace: every node of the run shares it), so that pods reach the
   API server through the `kubernetes` Service as in any cluster.
6. N - K API-only Nodes, whose Leases are renewed here as a kubelet renews its own (the node
   lifecycle controller would otherwise mark them unreachable).

`stop()` ends it all and gives the slot back, its host state swept.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from tests.cluster import cgroups, podnet
from tests.cluster.build import BIN, CONTROL_PLANE, NODE_IMAGES, NODE_RUNTIME
from tests.cluster.controlplane import ControlPlane, Proc, kubeconfig_text
from tests.cluster.images import Archive, static_image
from tests.cluster.node import CACHE, RealNode, daemons_cgroup, in_node
from tests.cluster.slot import Slot

LEASE_SECONDS = 40


def ensure_builds(log: Any = None) -> None:
    for build in (CONTROL_PLANE, NODE_RUNTIME, NODE_IMAGES):
        build.ensure(log)


class RealNodes:
    """A control plane in ``workdir`` with ``kubelets`` real nodes among ``nodes`` Nodes."""

    def __init__(self, workdir: Path, nodes: int, kubelets: int, images: list[Archive] | None = None,
                 labels: dict[str, str] | None = None) -> None:
        if not 0 < kubelets <= nodes:
            raise ValueError(f"--kubelet {kubelets}: between 1 and --nodes ({nodes})")
        self.workdir = workdir
        self.count, self.kubelets = nodes, kubelets
        self.extra_images = images or []
        self.labels = labels
        self.slot: Slot | None = None
        self.cp: ControlPlane | None = None
        self.nodes: list[RealNode] = []
        self.api_nodes: list[str] = []
        self.kube_proxy: Proc | None = None
        self.pause: Archive | None = None
        self.serve: Archive | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.timings: dict[str, float] = {}

    @property
    def host_ip(self) -> str:
        """Where pods reach this machine (a server for pods listens here)."""
        assert self.slot is not None
        return self.slot.names.host_ip

    def start(self) -> RealNodes:
        started = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - started
        return self

    def _start(self) -> None:
        mark = time.monotonic()
        ensure_builds()
        self.pause = static_image("pause")
        self.serve = static_image("serve")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.slot = Slot.claim([self.workdir, CACHE])
        names = self.slot.names
        podnet.create(names)
        cgroups.make(daemons_cgroup(names))
        self.timings["host"] = time.monotonic() - mark
        mark = time.monotonic()
        # In the run's cgroup tree too: a killed run's sweep ends them (a kube-apiserver whose etcd went
        # with its parent was seen to hang in its graceful shutdown for good).
        tree = daemons_cgroup(names)
        self.cp = ControlPlane(self.workdir, bin_dir=BIN, node_address=names.host_ip,
                               proc_setup=lambda: cgroups.join(tree)).start()
        self.timings["control plane"] = time.monotonic() - mark
        mark = time.monotonic()
        self.nodes = [RealNode(f"node-{i}", i, names, self.workdir / f"node-{i}", self.cp, self.pause.ref)
                      for i in range(1, self.kubelets + 1)]
        for node in self.nodes:
            node.start_runtime()
        self.timings["containerd"] = time.monotonic() - mark
        mark = time.monotonic()
        for node in self.nodes:
            node.load([self.pause, self.serve, *self.extra_images])
        self.timings["images"] = time.monotonic() - mark
        mark = time.monotonic()
        for node in self.nodes:
            node.start_kubelet(self.labels)
        for node in self.nodes:
            node.wait_ready()
        self.timings["kubelets ready"] = time.monotonic() - mark
        # After the Nodes exist: kube-proxy exits when its Node's addresses change ("NodeIPs changed",
        # for its DaemonSet to restart it), which a Node registering after its start is.
        self._start_kube_proxy()
        for i in range(self.kubelets + 1, self.count + 1):
            self.register_api_node(f"node-{i}", self.labels)
        self._heartbeat = threading.Thread(target=self._renew_leases, daemon=True)
        self._heartbeat.start()

    def _start_kube_proxy(self) -> None:
        assert self.cp is not None and self.cp.pki is not None and self.slot is not None
        names = self.slot.names
        # Inside the nodes' namespace the API server is at the link address, not loopback.
        pair = self.cp.pki.clients["kube-proxy"]
        kubeconfig = self.workdir / "kube-proxy.kubeconfig"
        kubeconfig.write_text(kubeconfig_text(f"https://{names.host_ip}:{self.cp.api_port}", self.cp.pki.ca,
                                              {"client-certificate": str(pair.cert), "client-key": str(pair.key)}))
        config = self.workdir / "kube-proxy.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables",
            "hostnameOverride": "node-1",
            "clusterCIDR": str(names.pods),
            "bindAddress": names.node_ip,
            "healthzBindAddress": "127.0.0.1:10256", "metricsBindAddress": "127.0.0.1:10249",
            # Leave the conntrack sysctls alone (some are the machine's, not the namespace's).
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
            # Pod -> Service -> pod on the same bridge answers directly unless the request is
            # masqueraded (br_netfilter would be the machine's setting).
            "iptables": {"masqueradeAll": True, "localhostNodePorts": False},
        }))
        self.kube_proxy = Proc("kube-proxy", [str(BIN / "kube-proxy"), "--config", str(config), "--v", "1"],
                               self.workdir / "kube-proxy.log", setup=in_node(names)).start()
        # Ready once the `kubernetes` Service answers from inside the namespace (its rules are in).
        deadline = time.monotonic() + 120
        probe = ["nsenter", f"--net={names.netns}", "curl", "-sk", "--max-time", "3", "https://10.96.0.1/readyz"]
        while subprocess.run(probe, capture_output=True, text=True).stdout != "ok":
            if not self.kube_proxy.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"kube-proxy did not route the kubernetes Service; its log ends:\n"
                                   f"{self.kube_proxy.log_tail()}")
            time.sleep(0.5)

    # ---- API-only Nodes --------------------------------------------------------------------

    def register_api_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        assert self.cp is not None
        self.cp.register_node(name, labels)
        self.api_nodes.append(name)
        self._renew(name)

    def _renew(self, name: str) -> None:
        assert self.cp is not None
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        status, _ = self.cp.raw(path, "PATCH", {"spec": {"renewTime": now}}, timeout=5)
        if status == 404:
            self.cp.raw("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", "POST", {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now}}, timeout=5)

    def _renew_leases(self) -> None:
        while not self._stop.wait(5):
            for name in list(self.api_nodes):
                try:
                    self._renew(name)
                except Exception:  # the control plane is stopping, or restarting under a test
                    continue

    # ---- the end ---------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(10)
        for node in self.nodes:
            node.stop_kubelet()
        if self.kube_proxy is not None:
            self.kube_proxy.stop()
        if self.slot is not None:
            cgroups.kill_all(self.slot.names.cgroup)  # the pods' containers and containerd's shims
        for node in self.nodes:
            node.stop()
        if self.cp is not None:
            self.cp.stop()
        if self.slot is not None:
            self.slot.release()
            self.slot = None

    def dead(self) -> list[str]:
        procs = [self.kube_proxy, *(p for n in self.nodes for p in (n.containerd, n.kubelet))]
        assert self.cp is not None
        procs += list(self.cp.procs.values())
        return [p.name for p in procs if p is not None and not p.alive()]

    def describe(self) -> str:
        return json.dumps({k: round(v, 1) for k, v in self.timings.items()})
