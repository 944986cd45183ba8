"""Builds the control plane's binaries from the Go module next to this file.

`go build` inside tests/cluster/ (which requires k8s.io/kubernetes at one release and maps its
staging modules to their published versions) gives kube-apiserver, kube-controller-manager,
kube-scheduler, kubectl and etcd in `.work/cluster/bin/`. A stamp of the pins (go.mod, go.sum,
our two Go files) skips the build when nothing changed; the Go build cache makes a rebuild
after a pin change incremental.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

MODULE = Path(__file__).resolve().parent
REPO = MODULE.parent.parent
BIN = REPO / ".work" / "cluster" / "bin"
COMMANDS = {
    "etcd": "./cmd/etcd",
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
}
_PIN_FILES = ("go.mod", "go.sum", "tools.go", "cmd/etcd/main.go")


def pinned_version(module: str) -> str:
    """The version go.mod requires for ``module`` (e.g. ``k8s.io/kubernetes`` -> ``v1.37.2``)."""
    m = re.search(rf"^\s*{re.escape(module)}\s+(v\S+)", (MODULE / "go.mod").read_text(), re.M)
    if not m:
        raise RuntimeError(f"{MODULE / 'go.mod'} does not require {module}")
    return m.group(1)


def kubernetes_version() -> str:
    return pinned_version("k8s.io/kubernetes")


def etcd_version() -> str:
    return pinned_version("go.etcd.io/etcd/server/v3")


def _stamp() -> str:
    h = hashlib.sha256(_ldflags().encode() + b"\0")
    for name in _PIN_FILES:
        h.update(name.encode() + b"\0" + (MODULE / name).read_bytes() + b"\0")
    return h.hexdigest()


def _ldflags() -> str:
    """Stamp the release into the binaries the way Kubernetes' own build does (hack/lib/version.sh),
    so `kubectl version` and /version show it instead of v0.0.0-master."""
    version = kubernetes_version()
    major, minor = version.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.gitVersion={version}", f"-X {pkg}.gitMajor={major}", f"-X {pkg}.gitMinor={minor}",
                  f"-X {pkg}.gitTreeState=clean", f"-X {pkg}.buildDate=1970-01-01T00:00:00Z"]
    return " ".join(flags)


def up_to_date(bin_dir: Path = BIN) -> bool:
    stamp = bin_dir / ".stamp"
    return (stamp.exists() and stamp.read_text() == _stamp()
            and all((bin_dir / name).exists() for name in COMMANDS))


def ensure_binaries(bin_dir: Path = BIN, log: Callable[[str], None] | None = None) -> Path:
    """Build the binaries unless the stamp says they match the pins; returns the bin folder."""
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if up_to_date(bin_dir):
        return bin_dir
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("the Kubernetes test cluster is built with Go: install Go 1.26 or newer")
    bin_dir.mkdir(parents=True, exist_ok=True)
    say(f"building Kubernetes {kubernetes_version()} and etcd {etcd_version()} from Go modules into {bin_dir} "
        "(the first build on a fresh machine takes about 10 minutes on 2 cores; later runs reuse it)")
    cmd = [go, "build", "-ldflags", _ldflags(), "-o", str(bin_dir) + os.sep, *COMMANDS.values()]
    env = {**os.environ, "GOTOOLCHAIN": os.environ.get("GOTOOLCHAIN", "local")}
    started = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(30):
            say(f"  still building ({time.monotonic() - started:.0f} s)")

    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        proc = subprocess.run(cmd, cwd=MODULE, env=env, capture_output=True, text=True)
    finally:
        done.set()
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise RuntimeError(f"go build of the test control plane failed ({proc.returncode}):\n{tail}")
    (bin_dir / ".stamp").write_text(_stamp())
    say(f"built the control plane in {time.monotonic() - started:.0f} s")
    return bin_dir


if __name__ == "__main__":
    ensure_binaries()
