"""The coordinator at scale on the real control plane (tests/cluster): convergence time, API requests
and peak memory.

5,000 Nodes shaped like real GPU nodes (100 container images in status, the usual annotations,
capacity, addresses, node info, and the managedFields the API server adds), 10 node groups, 200
caches (20 per group, so every node holds 20 entries). The coordinator runs as its own process,
as deploy/'s ServiceAccount; the agents are simulated by one watcher that marks every entry
ModelDownloaded (one status patch per changed LocalModelNode). Measured:

* seconds from creating the caches until every cache shows all its members available, and until
  the coordinator is done (its last request before 10 s without any: entries, node labels, events);
* the coordinator's API requests (its /metrics: modelcache_coordinator_api_requests_total), to
  converge and then during a quiet window with nothing changing (target 0; watches that reach
  their timeout and are reopened are counted apart);
* the coordinator's peak RSS (VmHWM).

    .venv/bin/python bench/coordinator_scale.py [--nodes 5000] [--groups 10] [--caches 200] [--workers 16] [--quiet 60]

Prints one JSON line and the README table row.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kubernetes.client.exceptions import ApiException  # noqa: E402

from modelcache.clock import rfc3339  # noqa: E402
from modelcache.kube.client import LOCAL_MODEL_CACHES, LOCAL_MODEL_NODES, NODES, Kube, load_api_client  # noqa: E402
from modelcache.kube.informer import Informer  # noqa: E402
from tests.cluster.baseline import apply_manifests  # noqa: E402
from tests.cluster.build import ensure_binaries  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.coordinator_util import make_cache, make_group  # noqa: E402
from tests.helpers import free_port  # noqa: E402

TARGETS = {"converge_seconds": 120, "quiet_requests": 0, "peak_rss_mib": 512}


def node_body(name: str, pool: str) -> dict[str, Any]:
    """A Node as a GPU node's kubelet and the cloud's controllers leave it."""
    images = [{"names": [f"registry.example.com/team-{i % 7}/serving-runtime-{i}@sha256:{i:064x}",
                         f"registry.example.com/team-{i % 7}/serving-runtime-{i}:v{i}.0.{i % 13}"],
               "sizeBytes": 500_000_000 + i * 7_919_123} for i in range(100)]
    resources = {"cpu": "96", "memory": "1056Gi", "pods": "110", "ephemeral-storage": "3500Gi", "nvidia.com/gpu": "8"}
    now = rfc3339()
    conditions = [{"type": t, "status": "False", "reason": f"Kubelet{t}", "message": f"kubelet has no {t}",
                   "lastHeartbeatTime": now, "lastTransitionTime": now}
                  for t in ("MemoryPressure", "DiskPressure", "PIDPressure")]
    conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                       "message": "kubelet is posting ready status", "lastHeartbeatTime": now,
                       "lastTransitionTime": now})
    return {"metadata": {"name": name, "labels": {
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": "p5.48xlarge", "topology.kubernetes.io/zone": "zone-a",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8", "kserve/localmodel": pool},
        "annotations": {"node.alpha.kubernetes.io/ttl": "0",
                        "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                        "csi.volume.kubernetes.io/nodeid": json.dumps({"ebs.csi.aws.com": f"i-{name}"}),
                        "nfd.node.kubernetes.io/feature-labels": ",".join(f"feature.{i}" for i in range(40))}},
        "spec": {"providerID": f"aws:///zone-a/i-{name}", "podCIDR": "10.0.0.0/24"},
        "status": {"capacity": resources, "allocatable": resources, "conditions": conditions, "images": images,
                   "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}, {"type": "Hostname", "address": name}],
                   "nodeInfo": {"machineID": "0" * 32, "systemUUID": "0" * 36, "bootID": "0" * 36,
                                "kernelVersion": "6.1.0", "osImage": "Ubuntu 22.04", "operatingSystem": "linux",
                                "architecture": "amd64", "containerRuntimeVersion": "containerd://1.7.0",
                                "kubeletVersion": "v1.37.2", "kubeProxyVersion": ""}}}


def make_nodes(kube: Kube, count: int, groups: int) -> None:
    def one(n: int) -> None:
        name = f"node-{n:05d}"
        kube.create(NODES, node_body(name, f"pool{n % groups}"))
        kube.patch(NODES, name, {"spec": {"taints": None}})  # as the node lifecycle controller would

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(count)))


class Agents:
    """Every agent at once: marks every entry ModelDownloaded when a LocalModelNode's spec changes."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.todo: queue.Queue[str] = queue.Queue()
        self.informer = Informer(kube, LOCAL_MODEL_NODES, watch_timeout=600)
        self.informer.add_handler(lambda _e, obj, _old: self.todo.put(obj["metadata"]["name"]))
        self.patches = 0
        self._stop = threading.Event()

    def start(self) -> Agents:
        self.informer.start()
        for _ in range(6):
            threading.Thread(target=self._work, daemon=True).start()
        return self

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                name = self.todo.get(timeout=0.5)
            except queue.Empty:
                continue
            lmn = self.informer.store.get_raw(name)
            if lmn is None:
                continue
            want = {(f"{m['namespace']}/{m['modelName']}" if m.get("namespace") else m["modelName"]): "ModelDownloaded"
                    for m in (lmn.get("spec") or {}).get("localModels") or []}
            have = (lmn.get("status") or {}).get("modelStatus") or {}
            if have == want:
                continue
            patch: dict[str, Any] = {k: None for k in have if k not in want}
            patch.update(want)
            try:
                self.kube.patch_status(LOCAL_MODEL_NODES, name, {"status": {"modelStatus": patch}})
                self.patches += 1
            except Exception as exc:  # a conflict or a hiccup: the next event retries
                print(f"agent patch {name}: {exc}", file=sys.stderr)
                self.todo.put(name)

    def stop(self) -> None:
        self._stop.set()
        self.informer.stop()


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^modelcache_coordinator_api_requests_total\{verb="(\w+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def rss(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", status, re.M).group(1)) // 1024  # type: ignore[union-attr]
            for k in ("VmRSS", "VmHWM")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--caches", type=int, default=200)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--quiet", type=float, default=60, help="seconds of the at-rest window")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="coordinator-scale-") as tmp:
        cp = ControlPlane(Path(tmp) / "cluster", bin_dir=ensure_binaries()).start()
        coordinator: subprocess.Popen[bytes] | None = None
        agents: Agents | None = None
        try:
            apply_manifests(cp)
            kube = Kube(load_api_client(str(cp.kubeconfig)))
            started = time.monotonic()
            for g in range(args.groups):
                make_group(kube, f"g{g}", label_value=f"pool{g}")
            make_nodes(kube, args.nodes, args.groups)
            setup_s = time.monotonic() - started
            members = {g: len(range(g, args.nodes, args.groups)) for g in range(args.groups)}

            port = free_port()
            env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig_for("modelcache-system", "modelcache-coordinator",
                                                                     seconds=24 * 3600))}
            log = open(Path(tmp) / "coordinator.log", "wb")  # noqa: SIM115 (closed with the directory)
            coordinator = subprocess.Popen(
                [sys.executable, "-m", "coordinator", "--no-leader-election", "--bind", "127.0.0.1", "--port",
                 str(port), "--workers", str(args.workers), "--log-level", "WARNING", "--no-mutate-isvc"],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 300
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    pass
                if coordinator.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"coordinator did not get ready:\n{(Path(tmp) / 'coordinator.log').read_text()}")
                time.sleep(0.5)
            idle = rss(coordinator.pid)
            agents = Agents(Kube(load_api_client(str(cp.kubeconfig)))).start()

            start = time.monotonic()
            for c in range(args.caches):
                make_cache(kube, f"cache-{c:03d}", f"s3://models/m{c}", [f"g{c % args.groups}"])

            def converged() -> bool:
                try:
                    items = kube.list(LOCAL_MODEL_CACHES).get("items") or []
                except ApiException as exc:  # a loaded API server timing out a 30 MB list: ask again
                    print(f"listing caches: {exc.status}", file=sys.stderr)
                    return False
                done = 0
                for item in items:
                    want = members[int(item["spec"]["nodeGroups"][0][1:])]
                    copies = (item.get("status") or {}).get("copies") or {}
                    done += copies.get("available") == want and copies.get("total") == want
                return len(items) == args.caches and done == args.caches

            while not converged():
                if time.monotonic() - start > args.timeout or coordinator.poll() is not None:
                    raise SystemExit("did not converge")
                time.sleep(3)
            available_s = time.monotonic() - start
            # Converged = the coordinator is done too (entries, node labels, events): its last
            # request before 10 s without any.
            last, last_change = metrics(port), time.monotonic()
            while time.monotonic() - last_change < 10:
                time.sleep(1)
                now = metrics(port)
                if {k: v for k, v in now.items() if k != "WATCH"} != {k: v for k, v in last.items() if k != "WATCH"}:
                    last, last_change = now, time.monotonic()
                if time.monotonic() - start > args.timeout:
                    raise SystemExit("the coordinator never settled")
            converge_s = last_change - start
            to_converge = last
            before = metrics(port)
            time.sleep(args.quiet)
            after = metrics(port)
            quiet = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) - before.get(k, 0)}
            mem = rss(coordinator.pid)
            result = {
                "nodes": args.nodes, "groups": args.groups, "caches": args.caches, "workers": args.workers,
                "setup_seconds": round(setup_s, 1), "caches_available_seconds": round(available_s, 1),
                "converge_seconds": round(converge_s, 1),
                "requests_to_converge": {k: int(v) for k, v in sorted(to_converge.items())},
                "quiet_seconds": args.quiet,
                "quiet_requests": int(sum(v for k, v in quiet.items() if k != "WATCH")),
                "quiet_requests_by_verb": {k: int(v) for k, v in quiet.items()},
                "quiet_watches_reopened": int(quiet.get("WATCH", 0)),
                "agent_status_patches": agents.patches,
                "rss_idle_mib": idle["VmRSS"], "peak_rss_mib": mem["VmHWM"], "rss_end_mib": mem["VmRSS"],
                "load_average": os.getloadavg()[0],
            }
            print(json.dumps(result))
            met = {k: ("met" if result[k] <= v else "missed") for k, v in TARGETS.items()}  # type: ignore[operator]
            print(f"| {args.nodes} nodes, {args.groups} groups, {args.caches} caches | "
                  f"{result['converge_seconds']} s ({met['converge_seconds']}) | "
                  f"{sum(result['requests_to_converge'].values())} | "
                  f"{result['quiet_requests']} in {args.quiet:.0f} s ({met['quiet_requests']}) | "
                  f"{result['peak_rss_mib']} MiB ({met['peak_rss_mib']}) |")
        finally:
            if agents is not None:
                agents.stop()
            if coordinator is not None:
                coordinator.terminate()
                coordinator.wait(30)
            cp.stop()


if __name__ == "__main__":
    main()
