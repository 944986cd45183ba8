"""Builds Go commands from a Go module of ours, for the tests; first of all the control plane's.

`GoCommands` is one such build: `go build` inside a module folder (whose go.mod pins the upstream
module and its replace lines) into an ignored bin folder, skipped while a stamp of the pins (go.mod,
go.sum, our Go files, the link flags) matches; the Go build cache makes a rebuild after a pin change
incremental. `CONTROL_PLANE` is the one next to this file: kube-apiserver, kube-controller-manager,
kube-scheduler, kubectl, etcd, and a node's kubelet and kube-proxy in `.work/cluster/bin/`;
`NODE_RUNTIME` (containerd, its runc shim, ctr) and `NODE_IMAGES` (the static programs that become
the nodes' pause and serving images) are built from tests/cluster/runtime/; tests/kserve/build.py is
another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

MODULE = Path(__file__).resolve().parent
REPO = MODULE.parent.parent
BIN = REPO / ".work" / "cluster" / "bin"


@dataclass(frozen=True)
class GoCommands:
    """Commands built with `go build` inside ``module`` into ``bin_dir``."""

    title: str  # what the build makes, for its progress lines ("Kubernetes v1.37.2 and etcd v3.7.3")
    module: Path
    bin_dir: Path
    commands: Mapping[str, str]  # binary name -> package path
    pin_files: tuple[str, ...]  # relative to module: any change means a rebuild
    ldflags: Callable[[], str] = lambda: "-s -w"
    cold_build: str = "several minutes"  # what a first build on a fresh 2-core machine costs
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # e.g. CGO_ENABLED=0 for static programs

    def pinned_version(self, module: str) -> str:
        """The version go.mod requires for ``module`` (e.g. ``k8s.io/kubernetes`` -> ``v1.37.2``)."""
        m = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", (self.module / "go.mod").read_text(), re.M)
        if not m:
            raise RuntimeError(f"{self.module / 'go.mod'} does not require {module}")
        return m.group(1)

    def stamp(self) -> str:
        h = hashlib.sha256(self.ldflags().encode() + b"\0")
        for key, value in sorted(self.env.items()):
            h.update(f"{key}={value}".encode() + b"\0")
        for name in self.pin_files:
            h.update(name.encode() + b"\0" + (self.module / name).read_bytes() + b"\0")
        return h.hexdigest()

    def up_to_date(self) -> bool:
        stamp = self.bin_dir / ".stamp"
        return (stamp.exists() and stamp.read_text() == self.stamp()
                and all((self.bin_dir / name).exists() for name in self.commands))

    def ensure(self, log: Callable[[str], None] | None = None) -> Path:
        """Build the binaries unless the stamp says they match the pins; returns the bin folder."""
        say = log or (lambda line: print(line, file=sys.stderr, flush=True))
        if self.up_to_date():
            return self.bin_dir
        go = shutil.which("go")
        if go is None:
            raise RuntimeError(f"{self.title} is built with Go: install Go 1.26 or newer")
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        say(f"building {self.title} from Go modules into {self.bin_dir} "
            f"(the first build on a fresh machine takes {self.cold_build} on 2 cores; later runs reuse it)")
        cmd = [go, "build", "-ldflags", self.ldflags(), "-o", str(self.bin_dir) + os.sep, *self.commands.values()]
        env = {**os.environ, "GOTOOLCHAIN": os.environ.get("GOTOOLCHAIN", "local"), **self.env}
        started = time.monotonic()
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(30):
                say(f"  still building ({time.monotonic() - started:.0f} s)")

        threading.Thread(target=heartbeat, daemon=True).start()
        try:
            proc = subprocess.run(cmd, cwd=self.module, env=env, capture_output=True, text=True)
        finally:
            done.set()
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
            raise RuntimeError(f"go build of {self.title} in {self.module} failed ({proc.returncode}):\n{tail}")
        (self.bin_dir / ".stamp").write_text(self.stamp())
        say(f"built {self.title} in {time.monotonic() - started:.0f} s")
        return self.bin_dir


def _kubernetes_ldflags() -> str:
    """Stamp the release into the binaries the way Kubernetes' own build does (hack/lib/version.sh),
    so `kubectl version` and /version show it instead of v0.0.0-master."""
    version = kubernetes_version()
    major, minor = version.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.gitVersion={version}", f"-X {pkg}.gitMajor={major}", f"-X {pkg}.gitMinor={minor}",
                  f"-X {pkg}.gitTreeState=clean", f"-X {pkg}.buildDate=1970-01-01T00:00:00Z"]
    return " ".join(flags)


CONTROL_PLANE = GoCommands(
    title="the test control plane",
    module=MODULE,
    bin_dir=BIN,
    commands={
        "etcd": "./cmd/etcd",
        "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
        "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
        "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
        "kubectl": "k8s.io/kubernetes/cmd/kubectl",
        # A real node (tests/cluster/node.py): the same release as the control plane.
        "kubelet": "k8s.io/kubernetes/cmd/kubelet",
        "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
    },
    pin_files=("go.mod", "go.sum", "tools.go", "cmd/etcd/main.go"),
    ldflags=_kubernetes_ldflags,
    cold_build="about 10 minutes",
)
COMMANDS = CONTROL_PLANE.commands
RUNTIME_MODULE = MODULE / "runtime"
NODE_RUNTIME = GoCommands(
    title="the nodes' container runtime (containerd)",
    module=RUNTIME_MODULE,
    bin_dir=REPO / ".work" / "cluster" / "runtime",
    commands={
        "containerd": "github.com/containerd/containerd/v2/cmd/containerd",
        "containerd-shim-runc-v2": "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
        "ctr": "github.com/containerd/containerd/v2/cmd/ctr",
    },
    pin_files=("go.mod", "go.sum", "tools.go"),
    # What containerd's own release build stamps in: the CRI reports it, `kubectl get nodes` shows it.
    ldflags=lambda: "-s -w -X github.com/containerd/containerd/v2/version.Version=" + NODE_RUNTIME.pinned_version(
        "github.com/containerd/containerd/v2").lstrip("v"),
    cold_build="about 3 minutes",
)
#: Programs that run in the nodes' images, which hold nothing else: linked statically.
NODE_IMAGES = GoCommands(
    title="the nodes' pause and serving programs",
    module=RUNTIME_MODULE,
    bin_dir=REPO / ".work" / "cluster" / "images",
    commands={"pause": "./cmd/pause", "serve": "./cmd/serve"},
    pin_files=("go.mod", "cmd/pause/main.go", "cmd/serve/main.go"),
    cold_build="a few seconds",
    env={"CGO_ENABLED": "0"},
)


def pinned_version(module: str) -> str:
    return CONTROL_PLANE.pinned_version(module)


def kubernetes_version() -> str:
    return pinned_version("k8s.io/kubernetes")


def etcd_version() -> str:
    return pinned_version("go.etcd.io/etcd/server/v3")


def up_to_date(bin_dir: Path = BIN) -> bool:
    return dataclasses.replace(CONTROL_PLANE, bin_dir=bin_dir).up_to_date()


def ensure_binaries(bin_dir: Path = BIN, log: Callable[[str], None] | None = None) -> Path:
    """Build the control plane unless the stamp says it matches the pins; returns the bin folder."""
    return dataclasses.replace(CONTROL_PLANE, bin_dir=bin_dir).ensure(log)


if __name__ == "__main__":
    ensure_binaries()
