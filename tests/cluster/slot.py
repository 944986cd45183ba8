"""A machine-wide slot for one run of test nodes, and the sweep of everything such a run leaves.

Kubelets, containerd, bridges, cgroups and mounts are machine-wide, and several test runs (pytest
workers, other worktrees) may start nodes at once. Each run claims a numbered slot by taking an
exclusive `flock` on `/run/modelcache-test-nodes/slot-N.lock`; every name it makes on the host
derives from N (its network namespace, veth pair, address ranges, cgroup tree), so runs never
collide. The kernel drops the lock when its owner dies however it dies, so whoever takes a slot
next knows the previous owner is gone and sweeps what it left: the processes in the slot's cgroup
tree (containerd's shims and the pods' containers outlive containerd by design), the mounts under
its folders (the kubelet's bind mount of its root dir, pod volumes, container root file systems,
the network namespace pins), its network namespace (the veth pair and the host route go with it),
and the cgroup tree. `release()` sweeps the same way at the end of a clean run.

Each node binds folders of its own over a few host paths in its mount namespace (`/models`, and
what the kubelet and libcni use whatever they are told); the empty mount points are made on the
host if missing and removed when the last slot is released, only if a test run made them (a
marker records it). The slot's run folder is a private bind mount of itself: a mount namespace
can only be pinned on a mount that does not propagate.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cluster import cgroups

STATE = Path("/run/modelcache-test-nodes")
#: On disk, short paths: the kubelets' root dirs (emptyDir volumes; unix sockets, which allow 107 bytes).
DATA = Path("/var/lib/modelcache-test-nodes")
SLOTS = 8
#: The host paths each node binds a folder of its own over (tests/cluster/node.py, NODE_PATHS): they
#: must exist as mount points; made by us -> removed (if empty) by the last run.
FIXED_PATHS = (Path("/models"), Path("/var/lib/kubelet"), Path("/var/log/containers"), Path("/var/lib/cni"))
_MNT_DETACH = 2


@dataclass(frozen=True)
class Names:
    """Everything on the host named after slot ``n``."""

    n: int

    @property
    def run_dir(self) -> Path:
        """Sockets, containerd's state, the namespace pins (under /run: gone with the machine)."""
        return STATE / f"slot-{self.n}"

    @property
    def data_dir(self) -> Path:
        return DATA / f"slot-{self.n}"

    @property
    def netns(self) -> Path:
        return self.run_dir / "netns"

    @property
    def cgroup(self) -> str:
        return f"/modelcache-test-{self.n}"

    @property
    def host_veth(self) -> str:
        return f"mctest{self.n}"

    @property
    def link(self) -> ipaddress.IPv4Network:
        """The /30 between the host (.1) and the nodes' network namespace (.2)."""
        return ipaddress.IPv4Network(f"172.31.{200 + self.n}.0/30")

    @property
    def host_ip(self) -> str:
        return str(self.link.network_address + 1)

    @property
    def node_ip(self) -> str:
        return str(self.link.network_address + 2)

    @property
    def pods(self) -> ipaddress.IPv4Network:
        """The pod network of the run's bridge; node i (1, 2, ...) hands out 10.<200+n>.<i>.0/24."""
        return ipaddress.IPv4Network(f"10.{200 + self.n}.0.0/16")

    def pod_cidr(self, index: int) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.{200 + self.n}.{index}.0/24")

    @property
    def cni_network(self) -> str:
        return f"modelcache-test-{self.n}"


def mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4].replace("\\040", " ") for line in f]


def unmount_under(*folders: Path) -> int:
    """Lazily unmount every mount at or below ``folders``, deepest first; returns how many."""
    prefixes = [str(f).rstrip("/") for f in folders]
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    done = 0
    for _ in range(5):  # a mount hidden below another shows up once that one is gone
        under = [m for m in mount_points() if any(m == p or m.startswith(p + "/") for p in prefixes)]
        if not under:
            break
        for point in sorted(set(under), key=lambda m: m.count("/"), reverse=True):
            if libc.umount2(point.encode(), _MNT_DETACH) == 0:
                done += 1
    return done


def _routes_in_use(*nets: ipaddress.IPv4Network) -> list[str]:
    """Routes of the host that overlap ``nets`` (another program's network in the same range)."""
    out = subprocess.run(["ip", "-4", "-o", "route", "show"], capture_output=True, text=True).stdout
    clashes = []
    for line in out.splitlines():
        dest = line.split()[0]
        if dest == "default":
            continue
        with contextlib.suppress(ValueError):
            if any(ipaddress.IPv4Network(dest, strict=False).overlaps(n) for n in nets):
                clashes.append(line.strip())
    return clashes


def _remove_ours(path: Path) -> None:
    """A mount point we made, if nothing was put in it (on the host, nothing of ours is)."""
    with contextlib.suppress(OSError):
        path.rmdir()


class Slot:
    """One claimed slot: its names, the folders it uses on disk, and its lock."""

    def __init__(self, n: int, fd: int) -> None:
        self.names = Names(n)
        self._fd = fd
        self.swept: list[str] = []  # what the claim found left by a dead owner

    @property
    def n(self) -> int:
        return self.names.n

    @classmethod
    def claim(cls, disk_dirs: list[Path], only: int | None = None, wait: float = 0) -> Slot:
        """The first free slot (or slot ``only``, waiting up to ``wait`` s for it), swept of what a
        dead owner left; ``disk_dirs`` are recorded so that the next owner can unmount what this
        run mounts there if it dies."""
        STATE.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + wait
        candidates = range(SLOTS) if only is None else [only]
        while True:
            slot = cls._take(candidates, disk_dirs)
            if slot is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if slot is None:
            raise RuntimeError(f"all {SLOTS} node slots of this machine are taken (locks in {STATE}): "
                               "stop another run of test nodes first" if only is None else
                               f"node slot {only} is taken (lock {STATE}/slot-{only}.lock)")
        return slot

    @classmethod
    def _take(cls, candidates: range | list[int], disk_dirs: list[Path]) -> Slot | None:
        for n in candidates:
            fd = os.open(STATE / f"slot-{n}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            slot = cls(n, fd)
            try:
                slot.swept = slot.sweep()
                clashes = _routes_in_use(slot.names.link, slot.names.pods)
                if clashes:
                    raise RuntimeError(f"the addresses of node slot {n} are in use on this machine: {clashes}")
                slot._mark_fixed_paths()
                slot.names.run_dir.mkdir(parents=True)
                run_dir = str(slot.names.run_dir)
                subprocess.run(["mount", "--bind", run_dir, run_dir], check=True, capture_output=True)
                subprocess.run(["mount", "--make-private", run_dir], check=True, capture_output=True)
                (slot.names.run_dir / "record.json").write_text(json.dumps(
                    {"owner": os.getpid(), "disk_dirs": [str(d) for d in disk_dirs]}))
            except BaseException:
                os.close(fd)
                raise
            return slot
        return None

    def sweep(self) -> list[str]:
        """Remove whatever this slot's previous run left on the host; what was found, for the log."""
        names = self.names
        found: list[str] = []
        disk: list[Path] = []
        record = names.run_dir / "record.json"
        with contextlib.suppress(OSError, ValueError):
            disk = [Path(d) for d in json.loads(record.read_text())["disk_dirs"]]
        killed = cgroups.kill_all(names.cgroup)
        if killed:
            found.append(f"{killed} processes")
        unmounted = unmount_under(names.run_dir, names.data_dir, *disk)
        if unmounted:
            found.append(f"{unmounted} mounts")
        if subprocess.run(["ip", "link", "show", names.host_veth], capture_output=True).returncode == 0:
            subprocess.run(["ip", "link", "del", names.host_veth], capture_output=True)
            found.append(f"link {names.host_veth}")
        for folder in (names.run_dir, names.data_dir):
            if folder.exists():
                shutil.rmtree(folder)
        if cgroups._dirs(names.cgroup):
            cgroups.remove(names.cgroup)
            found.append(f"cgroup {names.cgroup}")
        return found

    def _mark_fixed_paths(self) -> None:
        for path in FIXED_PATHS:
            marker = STATE / f"made{str(path).replace('/', '-')}"
            if not path.exists():
                marker.touch()
                path.mkdir(parents=True)

    def _others_alive(self) -> bool:
        for n in range(SLOTS):
            if n == self.n or not (STATE / f"slot-{n}.lock").exists():
                continue
            fd = os.open(STATE / f"slot-{n}.lock", os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            finally:
                os.close(fd)
        return False

    def release(self) -> None:
        """Sweep, remove the fixed paths if this is the last run and test runs made them, unlock."""
        try:
            self.sweep()
            if not self._others_alive():
                for path in FIXED_PATHS:
                    marker = STATE / f"made{str(path).replace('/', '-')}"
                    if marker.exists():
                        _remove_ours(path)
                        marker.unlink()
                with contextlib.suppress(OSError):
                    DATA.rmdir()
        finally:
            os.close(self._fd)
