"""`python -m tests.cluster up DIR [--nodes N [--kubelet K [--image REF ...]]]` | `python -m tests.cluster build`

`up` builds the binaries if the pins changed, starts etcd, kube-apiserver,
kube-controller-manager and kube-scheduler on free loopback ports, writes DIR/kubeconfig (the
admin's), registers N Ready Nodes, prints `ready <seconds>` and runs until SIGTERM or SIGINT,
then stops everything it started.

With `--kubelet K` the first K of the N Nodes are real (tests/cluster/realnodes.py): a kubelet and
a containerd each, pods on a bridge of this machine, the project image (`make image`; or each
`--image`) and our serving image loaded; `ready` is printed once every kubelet's Node is Ready, and
the stop removes everything the run made on the host (the next start sweeps what a killed one left).
Needs root. `build` also builds the nodes' runtime.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from tests.cluster.controlplane import ControlPlane


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run a control plane in the foreground")
    up.add_argument("dir", type=Path, help="working folder: data, certificates, logs and DIR/kubeconfig")
    up.add_argument("--nodes", type=int, default=0, help="register this many Ready Nodes (node-1, node-2, ...)")
    up.add_argument("--kubelet", type=int, default=0, metavar="K",
                    help="make the first K of the Nodes real: a kubelet and a containerd each (needs root)")
    up.add_argument("--image", action="append", default=None, metavar="REF",
                    help="an image of podman's to load into the real nodes (default: the project's, `make image`)")
    sub.add_parser("build", help="build the binaries (if the pins changed) and exit")
    args = parser.parse_args(argv)
    if args.command == "build":
        from tests.cluster.realnodes import ensure_builds

        ensure_builds()
        return 0
    if args.nodes < 0:
        parser.error("--nodes must be 0 or more")
    if args.kubelet:
        if not 0 < args.kubelet <= args.nodes:
            parser.error(f"--kubelet must be between 1 and --nodes ({args.nodes})")
        return _up_with_kubelets(args.dir.resolve(), args.nodes, args.kubelet, args.image)

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


def _up_with_kubelets(workdir: Path, nodes: int, kubelets: int, images: list[str] | None) -> int:
    from tests.cluster.images import podman_archive, project_image
    from tests.cluster.realnodes import RealNodes

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    run: RealNodes | None = None
    try:
        refs = images if images is not None else [project_image()]
        archives = []
        for ref in refs:
            try:
                archives.append(podman_archive(ref))
            except RuntimeError as exc:
                if images is not None:
                    raise
                print(f"note: {exc}; the nodes start without it", file=sys.stderr, flush=True)
        run = RealNodes(workdir, nodes, kubelets, archives).start()
        assert run.cp is not None
        print(f"ready {time.monotonic() - started:.1f}", flush=True)
        print(f"kubeconfig {run.cp.kubeconfig}", file=sys.stderr, flush=True)
        assert run.slot is not None
        swept = f" (swept what a killed run left: {', '.join(run.slot.swept)})" if run.slot.swept else ""
        print(f"slot {run.slot.n}{swept}; pods reach this machine at {run.host_ip}; timings {run.describe()}",
              file=sys.stderr, flush=True)
        while not stop.wait(1):
            dead = run.dead()
            if dead:
                print(f"error: {', '.join(dead)} exited; logs are in {workdir}", file=sys.stderr)
                return 1
        return 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if run is not None:
            run.stop()


if __name__ == "__main__":
    sys.exit(main())
