"""Helpers for tests on real nodes: what a run leaves on the host, and running `up` as a process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cluster import cgroups
from tests.cluster.slot import DATA, FIXED_PATHS, SLOTS, STATE, Names
from tests.helpers import REPO


@dataclass(frozen=True)
class HostState:
    """What a run of test nodes may change on this machine, as seen from the host."""

    links: frozenset[str]
    routes: frozenset[str]
    mounts: frozenset[str]
    cgroups: frozenset[str]
    iptables: str
    nftables: str
    ip_forward: str
    fixed_paths: frozenset[str]
    slot_dirs: frozenset[str]

    def differences(self, other: HostState, slot: int | None = None) -> list[str]:
        """What changed; with ``slot``, what other runs' slots made meanwhile is not counted (another
        worktree's or worker's run may start or stop during a test), nor the shared mount points."""
        out = []
        for name in ("links", "routes", "mounts", "cgroups", "fixed_paths", "slot_dirs"):
            before, after = getattr(self, name), getattr(other, name)
            if slot is not None:
                if name == "fixed_paths":
                    continue
                before, after = _own(before, slot), _own(after, slot)
            if before != after:
                out.append(f"{name}: added {sorted(after - before)}, removed {sorted(before - after)}")
        for name in ("iptables", "nftables", "ip_forward"):
            if getattr(self, name) != getattr(other, name):
                out.append(f"{name} changed:\n{getattr(self, name)}\n--- now ---\n{getattr(other, name)}")
        return out


def _own(entries: frozenset[str], slot: int) -> frozenset[str]:
    """Entries that are not another slot's (tests/cluster/slot.py names everything after its slot)."""
    others = [Names(n) for n in range(SLOTS) if n != slot]
    keys = [k for o in others for k in (o.host_veth, o.cgroup.strip("/"), str(o.run_dir), str(o.data_dir),
                                         f"slot-{o.n}", str(o.link.network_address), str(o.pods.network_address))]
    return frozenset(e for e in entries if not any(_names(e, k) for k in keys))


def _names(entry: str, key: str) -> bool:
    import re

    return re.search(rf"(^|[\s:/]){re.escape(key)}($|[\s/])", entry) is not None


def _lines(*cmd: str) -> list[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.stdout.splitlines() if proc.returncode == 0 else [f"({cmd[0]} failed: {proc.stderr.strip()})"]


def _rules(*cmd: str) -> str:
    """A ruleset without its counters and comment lines (which carry dates)."""
    return "\n".join(line for line in _lines(*cmd) if not line.startswith("#") and not line.startswith(":")
                     ) + "\n" + "\n".join(line.split(" [")[0] for line in _lines(*cmd) if line.startswith(":"))


def host_state(run_dirs: tuple[Path, ...] = ()) -> HostState:
    """``run_dirs``: folders of the runs under test; any mount below them counts."""
    top: set[str] = set()
    for hierarchy in cgroups.hierarchies():
        top |= {f"{hierarchy.name}:{d.name}" for d in hierarchy.iterdir() if d.is_dir()}
    mounts = {m for m in (line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines())
              if m.startswith((str(STATE), str(DATA), *map(str, FIXED_PATHS), *map(str, run_dirs)))}
    return HostState(
        links=frozenset(line.split(":")[1].strip().split("@")[0] for line in _lines("ip", "-o", "link", "show")),
        routes=frozenset(_lines("ip", "-4", "route", "show")),
        mounts=frozenset(mounts),
        cgroups=frozenset(top),
        iptables=_rules("iptables-save") + _rules("ip6tables-save"),
        nftables="\n".join(_lines("nft", "list", "ruleset")) if _tool("nft") else "",
        ip_forward=Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
        fixed_paths=frozenset(str(p) for p in (*FIXED_PATHS, DATA) if p.exists()),
        slot_dirs=frozenset(p.name for p in STATE.glob("slot-*") if p.is_dir()) if STATE.is_dir() else frozenset(),
    )


def _tool(name: str) -> bool:
    return subprocess.run(["sh", "-c", f"command -v {name}"], capture_output=True).returncode == 0


class Up:
    """`python -m tests.cluster up DIR ...` as a process, as a user starts it."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.workdir = workdir
        self.log = workdir.with_suffix(".log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.cluster", "up", str(workdir), *args], cwd=REPO,
                                         stdout=subprocess.PIPE, stderr=log, text=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float = 600) -> float:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = self.proc.stdout.readline()  # `up` prints nothing else on stdout
        if not line.startswith("ready ") or time.monotonic() > deadline:
            self.proc.kill()
            raise AssertionError(f"`up` printed {line!r}; its log:\n{self.log.read_text()[-5000:]}")
        return float(line.split()[1])

    def stop(self, timeout: float = 120) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout)

    def stderr(self) -> str:
        return self.log.read_text()

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"


def kubectl(kubeconfig: Path, *args: str, input: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    from tests.cluster.build import BIN

    proc = subprocess.run([str(BIN / "kubectl"), "--kubeconfig", str(kubeconfig), *args], input=input,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def safetensors(tensors: dict[str, tuple[str, list[int]]], fill: int = 7) -> bytes:
    """A safetensors file: its header, then each tensor's bytes (``fill`` repeated)."""
    import json
    import struct

    widths = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1}
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = widths[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes([fill]) * offset
