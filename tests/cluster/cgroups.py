"""The cgroup trees a run of test nodes owns: made, joined, emptied and removed in every hierarchy.

Every process of a run (containerd and its shims, the kubelets, kube-proxy) is started inside the
run's tree, and the kubelets put their pods below it (their `cgroupRoot`), so the tree is the list
of what the run left running: `kill_all` ends it whether the run stopped cleanly or was killed. On
cgroup v1 (these machines: cpu, memory, pids, ... and the hybrid cgroup2 at `unified`) a tree is a
directory in each hierarchy; on a pure cgroup2 machine it is one directory.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"


def hierarchies() -> list[Path]:
    """The mount point of every cgroup hierarchy (v1 and v2) this process sees."""
    seen: dict[str, Path] = {}
    with open(MOUNTINFO) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype = right.split()[0]
            if fstype not in ("cgroup", "cgroup2"):
                continue
            root, point = left.split()[3], left.split()[4]
            if root != "/":
                continue  # a bind of a sub-tree (a container's view), not the hierarchy
            options = right.split()[2] if fstype == "cgroup" else "cgroup2"
            seen.setdefault(options, Path(point.replace("\\040", " ")))
    return sorted(seen.values())


def make(tree: str) -> None:
    """Create ``tree`` (an absolute cgroup path like /modelcache-test-0/node-1) in every hierarchy.
    A new cpuset cgroup on v1 has no CPUs or memory nodes and admits no process: take the parent's."""
    for hierarchy in hierarchies():
        path = hierarchy
        for part in tree.strip("/").split("/"):
            parent, path = path, path / part
            if path.is_dir():
                continue
            path.mkdir()
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (path / name).exists() and not (path / name).read_text().strip():
                    (path / name).write_text((parent / name).read_text())


def join(tree: str) -> None:
    """Move the calling process into ``tree`` in every hierarchy (run in a child before exec)."""
    for hierarchy in hierarchies():
        target = hierarchy / tree.strip("/") / "cgroup.procs"
        if target.exists():
            with open(target, "w") as f:
                f.write("0")


def _dirs(tree: str) -> list[Path]:
    """Every directory of ``tree`` in every hierarchy, deepest first."""
    out: list[Path] = []
    for hierarchy in hierarchies():
        top = hierarchy / tree.strip("/")
        if top.is_dir():
            out += sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda p: len(p.parts), reverse=True)
    return out


def pids(tree: str) -> set[int]:
    found: set[int] = set()
    for d in _dirs(tree):
        try:
            found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        except OSError:
            continue
    found.discard(os.getpid())
    return found


def kill_all(tree: str, timeout: float = 30) -> int:
    """SIGKILL every process in ``tree`` until none is left; returns how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        left = pids(tree)
        if not left:
            return len(killed)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(left)} in cgroup {tree} survived SIGKILL for {timeout:.0f} s")
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def remove(tree: str, timeout: float = 30) -> None:
    """Remove ``tree`` from every hierarchy, deepest first (each must be empty of processes). A
    cgroup whose last process just died can stay busy for a moment."""
    deadline = time.monotonic() + timeout
    for d in _dirs(tree):
        while d.is_dir():
            try:
                d.rmdir()
            except FileNotFoundError:
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cannot remove cgroup {d}: {exc.strerror}") from None
                time.sleep(0.1)
