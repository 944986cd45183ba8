"""The network of a run's test nodes: a network namespace of its own, linked to the host.

The kubelets, their containerds and kube-proxy run in one network namespace per run (pinned at the
slot's `netns` file); their pods hang off a bridge inside it (the CNI bridge plugin makes it at the
first pod). A veth pair links it to the host: the host end has the slot's .1, the namespace end the
.2, which is every node's InternalIP (the API server reaches each kubelet there, on its own port).
The host routes the pod network through the namespace, so the API server, the tests and the
servers they start reach pods by their IPs, and pods reach the host at the .1 (a test server for
pods listens there). Inside the namespace kube-proxy's rules send the `kubernetes` Service to the
API server, as in any cluster.

Nothing of it is in the host's own network configuration but the host end of the veth and its
route, and both go with the namespace: the bridge, the pods' veths, ip_forward and kube-proxy's
iptables rules all live inside it.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.cluster.slot import Names

CNI_BIN = Path("/usr/lib/cni")
BRIDGE = "mcbr0"  # inside the namespace: no other run sees it
_CLONE_NEWNET = 0x40000000


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def enter(pin: Path, kind: int = _CLONE_NEWNET) -> None:
    """Move the calling process into the namespace pinned at ``pin`` (in a child before exec)."""
    fd = os.open(pin, os.O_RDONLY)
    try:
        if ctypes.CDLL("libc.so.6", use_errno=True).setns(fd, kind) != 0:
            raise OSError(ctypes.get_errno(), f"setns {pin}")
    finally:
        os.close(fd)


def create(names: Names) -> None:
    """The namespace, the veth pair, the addresses and the routes of slot ``names``."""
    names.netns.parent.mkdir(parents=True, exist_ok=True)
    names.netns.touch()
    _run("unshare", f"--net={names.netns}", "true")  # the namespace stays while its file is mounted
    inside = ("nsenter", f"--net={names.netns}")
    _run(*inside, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", names.host_veth,
         "netns", str(os.getpid()))
    _run("ip", "addr", "add", f"{names.host_ip}/{names.link.prefixlen}", "dev", names.host_veth)
    _run("ip", "link", "set", names.host_veth, "up")
    _run(*inside, "ip", "addr", "add", f"{names.node_ip}/{names.link.prefixlen}", "dev", "eth0")
    _run(*inside, "ip", "link", "set", "eth0", "up")
    _run(*inside, "ip", "link", "set", "lo", "up")
    _run(*inside, "ip", "route", "add", "default", "via", names.host_ip)
    # Between eth0 and the bridge; the bridge plugin (isGateway) would set it too, at the first pod.
    _run(*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    _run("ip", "route", "add", str(names.pods), "via", names.node_ip)


def cni_config(names: Names, index: int, ipam_dir: Path) -> dict[str, Any]:
    """Node ``index``'s CNI network: the run's bridge and gateway, addresses from the node's own /24."""
    cidr = names.pod_cidr(index)
    hosts = list(cidr.hosts())
    return {
        "cniVersion": "1.0.0",
        "name": names.cni_network,
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "dataDir": str(ipam_dir),
                      "ranges": [[{"subnet": str(names.pods), "rangeStart": str(hosts[1]),
                                   "rangeEnd": str(hosts[-1]), "gateway": str(names.pods.network_address + 1)}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "loopback"},
        ],
    }
