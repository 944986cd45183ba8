"""`python -m tests.cluster up DIR [--nodes N]` | `python -m tests.cluster build`

`up` builds the binaries if the pins changed, starts etcd, kube-apiserver,
kube-controller-manager and kube-scheduler on free loopback ports, writes DIR/kubeconfig (the
admin's), registers N Ready Nodes, prints `ready <seconds>` and runs until SIGTERM or SIGINT,
then stops everything it started.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from tests.cluster.build import ensure_binaries
from tests.cluster.controlplane import ControlPlane


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run a control plane in the foreground")
    up.add_argument("dir", type=Path, help="working folder: data, certificates, logs and DIR/kubeconfig")
    up.add_argument("--nodes", type=int, default=0, help="register this many Ready Nodes (node-1, node-2, ...)")
    sub.add_parser("build", help="build the binaries (if the pins changed) and exit")
    args = parser.parse_args(argv)
    if args.command == "build":
        ensure_binaries()
        return 0
    if args.nodes < 0:
        parser.error("--nodes must be 0 or more")

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    cp = ControlPlane(args.dir.resolve())
    try:
        cp.start()
        for i in range(args.nodes):
            cp.register_node(f"node-{i + 1}")
        print(f"ready {time.monotonic() - started:.1f}", flush=True)
        print(f"kubeconfig {cp.kubeconfig}", file=sys.stderr, flush=True)
        while not stop.wait(1):
            dead = [p.name for p in cp.procs.values() if not p.alive()]
            if dead:
                print(f"error: {', '.join(dead)} exited; logs are in {args.dir}", file=sys.stderr)
                return 1
        return 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        cp.stop()


if __name__ == "__main__":
    sys.exit(main())
