"""The coordinator at scale on the real control plane (tests/cluster), against the fewest writes the
same state needs, in the same run.

N Nodes shaped like real GPU nodes (100 container images in status, the usual annotations,
capacity, addresses, node info, and the managedFields the API server adds), G node groups, C caches
spread over them (every node of a group holds all its group's caches). The agents are simulated
by one watcher that marks every entry ModelDownloaded (one status patch per changed
LocalModelNode). Two phases, one control plane, one after the other:

1. **Baseline**: a plain client (no informers of its own state, no coordinator logic) at the
   coordinator's concurrency (``--workers`` threads in all, one queue, as the coordinator's node
   controller) writes exactly what the state needs: each
   node's LocalModelNode with all its entries (one POST), then, once the simulated agent reports
   the models, the node's ``downloaded.modelcache.io/*`` labels (one PATCH). Timed from the first
   write to the last label. Then everything it wrote is removed (untimed).
2. **Coordinator**: the coordinator as its own process, as deploy/'s ServiceAccount, with
   ``--workers``; C caches are created and it converges. Converged = every cache shows all its
   members available and the coordinator has made its last request (entries, node labels,
   cache statuses, events): its last request before 10 s without any.

Reported: the convergence time as a ratio to the baseline's (target <= 1.3), the coordinator's API
requests from the first cache to convergence per node (target <= 2.2; the baseline needs 2), its
CPU seconds per 1,000 nodes, its peak RSS (VmHWM, target <= 512 MiB), and its requests during a
quiet window after convergence (target 0; watches that reach their timeout and are reopened are
counted apart). The machine's load average at the start and the end of each phase.

    .venv/bin/python bench/coordinator_scale.py [--nodes 10000] [--groups 10] [--caches 200] [--workers 16]
        [--quiet 60] [--json FILE] [--by-group]

Prints one JSON line (also written to ``--json``) and the README table row.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kubernetes.client.exceptions import ApiException  # noqa: E402
from urllib3.exceptions import HTTPError  # noqa: E402

from bench import profiler  # noqa: E402  (needs the repo on sys.path)
from coordinator.entries import desired_entry  # noqa: E402
from coordinator.nodelabels import LABEL_VALUE, model_label  # noqa: E402
from modelcache.kube.client import (  # noqa: E402
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NODES,
    NODES,
    Kube,
    count_requests,
    load_api_client,
)
from modelcache.kube.informer import Informer  # noqa: E402
from modelcache.kube.types import MODEL_DOWNLOADED  # noqa: E402
from modelcache.runtime.clock import rfc3339  # noqa: E402
from tests.cluster.baseline import apply_manifests  # noqa: E402
from tests.cluster.build import ensure_binaries  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.coordinator_util import make_cache, make_group  # noqa: E402
from tests.helpers import free_port  # noqa: E402


def progress(message: str) -> None:
    """One line on stderr per phase: a 10,000-node run takes tens of minutes."""
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}: {message}", file=sys.stderr, flush=True)


TARGETS = {"converge_vs_baseline": 1.3, "requests_per_node": 2.2, "quiet_requests": 0, "peak_rss_mib": 512}
#: Threads that create the Nodes (setup, untimed).
SETUP_THREADS = 16


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


def node_name(n: int) -> str:
    return f"node-{n:05d}"


def make_nodes(kube: Kube, count: int, groups: int) -> None:
    def one(n: int) -> None:
        name = node_name(n)
        retried(f"Node {name}", lambda: kube.create(NODES, node_body(name, f"pool{n % groups}")))
        # as the node lifecycle controller would
        retried(f"Node {name}", lambda: kube.patch(NODES, name, {"spec": {"taints": None}}))

    with ThreadPoolExecutor(SETUP_THREADS) as pool:
        list(pool.map(one, range(count)))


def cache_name(c: int) -> str:
    return f"cache-{c:03d}"


def cache_uri(c: int) -> str:
    return f"s3://models/m{c}"


def wanted_states(lmn: dict[str, Any]) -> dict[str, str]:
    return {(f"{m['namespace']}/{m['modelName']}" if m.get("namespace") else m["modelName"]): MODEL_DOWNLOADED
            for m in (lmn.get("spec") or {}).get("localModels") or []}


class Agents:
    """Every agent at once: marks every entry ModelDownloaded when a LocalModelNode's spec changes."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.todo: queue.Queue[str] = queue.Queue()
        self.informer = Informer(kube, LOCAL_MODEL_NODES, watch_timeout=600)
        self.informer.add_handler(self._event)
        self.patches = 0
        self.extra: Any = None  # the baseline's handler, while it runs
        self._stop = threading.Event()

    def _event(self, event: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        self.todo.put(obj["metadata"]["name"])
        if self.extra is not None:
            self.extra(event, obj, old)

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
            want = wanted_states(lmn)
            have = (lmn.get("status") or {}).get("modelStatus") or {}
            if have == want:
                continue
            patch: dict[str, Any] = {k: None for k in have if k not in want}
            patch.update(want)
            try:
                self.kube.patch_status(LOCAL_MODEL_NODES, name, {"status": {"modelStatus": patch}})
                self.patches += 1
            except ApiException as exc:
                if exc.status != 404:  # a conflict or a hiccup: the next event retries
                    print(f"agent patch {name}: {exc.status}", file=sys.stderr)
                    self.todo.put(name)

    def stop(self) -> None:
        self._stop.set()
        self.informer.stop()


def retried(what: str, call: Callable[[], Any], attempts: int = 30) -> None:
    """``call`` until it succeeds, as any client does on a loaded server: 429, 5xx (etcd timing out
    on a busy machine) and broken connections are tried again; 409 after a retried create means
    an earlier attempt went through."""
    for attempt in range(attempts):
        try:
            call()
            return
        except ApiException as exc:
            if exc.status == 409 and attempt:
                return
            if exc.status not in (429, 500, 502, 503, 504) or attempt == attempts - 1:
                raise RuntimeError(f"{what}: {exc.status} {exc.reason}") from exc
        except OSError as exc:  # urllib3's connection errors are OSErrors
            if attempt == attempts - 1:
                raise RuntimeError(f"{what}: {exc}") from exc
        time.sleep(min(5.0, 0.2 * 2 ** attempt))


class Counter:
    """Requests a client sends, by HTTP verb."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_verb: dict[str, int] = {}

    def __call__(self, verb: str) -> None:
        with self.lock:
            self.by_verb[verb] = self.by_verb.get(verb, 0) + 1


def baseline(kubeconfig: str, agents: Agents, nodes: int, groups: int, caches: int, workers: int,
             timeout: float) -> dict[str, Any]:
    """The fewest writes the converged state needs, by a plain client at ``workers`` concurrency
    (``workers`` threads in all, as the coordinator's node controller): each node's
    LocalModelNode with all its entries, then its downloaded-model labels once the (simulated)
    agent reports the models."""
    api = load_api_client(kubeconfig)
    counter = Counter()
    count_requests(api, counter)
    kube = Kube(api)
    group_entries = {g: [desired_entry({"metadata": {"name": cache_name(c)}, "spec": {"sourceModelUri": cache_uri(c)}},
                                       f"g{g}") for c in range(g, caches, groups)] for g in range(groups)}
    labels = {g: {model_label(e["sourceModelUri"]): LABEL_VALUE for e in group_entries[g]} for g in range(groups)}
    # One queue and ``workers`` threads, as the coordinator's node controller (whose workers write
    # both): every node's LocalModelNode first, then each node's labels as its agent reports.
    work: queue.Queue[tuple[str, str] | None] = queue.Queue()
    labelled: set[str] = set()
    lock = threading.Lock()

    def reported(_e: str, obj: dict[str, Any], _old: dict[str, Any] | None) -> None:
        if obj.get("spec") and ((obj.get("status") or {}).get("modelStatus") or {}) == wanted_states(obj):
            work.put(("label", obj["metadata"]["name"]))

    # What the agents report is read from the agents' own watch (a read, not a write: nothing is
    # counted against the baseline's client for it). Removed again by ``undo_baseline``.
    agents.extra = reported
    done = threading.Event()
    last = [0.0]
    #: Each worker thread's CPU seconds (time.thread_time), added as it ends: the client's own CPU,
    #: apart from the simulated agents' in this process.
    worker_cpu: list[float] = []

    def worker() -> None:
        cpu0 = time.thread_time()
        try:
            work_loop()
        finally:
            with lock:
                worker_cpu.append(time.thread_time() - cpu0)

    def work_loop() -> None:
        while True:
            item = work.get()
            if item is None:
                return
            what, name = item
            group = int(name.split("-")[1]) % groups
            if what == "create":
                retried(f"LocalModelNode {name}", lambda n=name, g=group: kube.create(LOCAL_MODEL_NODES, {
                    "metadata": {"name": n}, "spec": {"localModels": group_entries[g]}}))
                continue
            with lock:
                if name in labelled:
                    continue
                labelled.add(name)
            retried(f"label {name}", lambda n=name, g=group: kube.patch(NODES, n, {"metadata": {"labels": labels[g]}}))
            with lock:
                last[0] = time.monotonic()
                if len(labelled) == nodes:
                    done.set()

    load = os.getloadavg()[0]
    start = time.monotonic()
    for n in range(nodes):
        work.put(("create", node_name(n)))
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    if not done.wait(timeout):
        raise SystemExit(f"baseline: {len(labelled)} of {nodes} nodes labelled in {timeout:.0f} s")
    seconds = last[0] - start
    for _ in threads:
        work.put(None)
    for t in threads:
        t.join(60)
    return {"seconds": round(seconds, 1), "requests": dict(sorted(counter.by_verb.items())),
            "client_cpu_seconds": round(sum(worker_cpu), 1),
            "load_average": [round(load, 1), round(os.getloadavg()[0], 1)]}


def undo_baseline(cp: ControlPlane, kube: Kube, agents: Agents, nodes: int, groups: int, caches: int) -> None:
    """Remove what the baseline wrote (untimed): the LocalModelNodes and the nodes' labels."""
    # deletecollection (kubectl delete --all sends one DELETE per object: 10,000 took longer than
    # its 120 s at load 17). The API server stops when the request times out (504 after 60 s at
    # 10,000, 434 left): asked again while any are left.
    res = LOCAL_MODEL_NODES

    def delete_all() -> None:
        try:
            kube.custom.delete_collection_cluster_custom_object(res.group, res.version, res.plural,
                                                                _preload_content=False).release_conn()
        except (ApiException, HTTPError, OSError) as exc:
            print(f"deleting the baseline's LocalModelNodes: {type(exc).__name__}; asking again", file=sys.stderr)

    delete_all()

    def unlabel(n: int) -> None:
        drop = {model_label(cache_uri(c)): None for c in range(n % groups, caches, groups)}
        retried(f"Node {node_name(n)}", lambda: kube.patch(NODES, node_name(n), {"metadata": {"labels": drop}}))

    with ThreadPoolExecutor(SETUP_THREADS) as pool:
        list(pool.map(unlabel, range(nodes)))
    deadline = time.monotonic() + 1800
    asked = time.monotonic()
    while len(agents.informer.store):
        if time.monotonic() > deadline:
            raise SystemExit("the baseline's LocalModelNodes are still there after 1800 s")
        time.sleep(1)
        if len(agents.informer.store) and time.monotonic() - asked > 30:  # the watch lags the deletes
            delete_all()
            asked = time.monotonic()
    agents.patches = 0
    agents.extra = None


def cache_copies(obj: dict[str, Any]) -> dict[str, Any]:
    """What convergence reads of a cache (its nodeStatus is most of it)."""
    return {"metadata": obj["metadata"], "spec": obj.get("spec") or {},
            "status": {"copies": (obj.get("status") or {}).get("copies") or {}}}


def coordinator_metrics(port: int) -> tuple[dict[str, float], dict[str, float]]:
    """(API requests by verb, API writes by "kind verb" and reconciles by "reconcile controller
    outcome") from the coordinator's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    requests = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^modelcache_coordinator_api_requests_total\{verb="(\w+)"\} (\S+)$', text, re.M)}
    writes = {f"{m.group(1)} {m.group(2)}": float(m.group(3)) for m in re.finditer(
        r'^modelcache_coordinator_api_writes_total\{kind="(\w+)",verb="(\w+)"\} (\S+)$', text, re.M)}
    writes.update({f"reconcile {m.group(1)} {m.group(2)}": float(m.group(3)) for m in re.finditer(
        r'^modelcache_coordinator_reconciles_total\{controller="(\w+)",outcome="(\w+)"\} (\S+)$', text, re.M)})
    return requests, writes


def rss(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", status, re.M).group(1)) // 1024  # type: ignore[union-attr]
            for k in ("VmRSS", "VmHWM")}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


#: The control plane's processes whose CPU each phase reports: on 2 cores the API server and etcd
#: are what both phases wait on, so CPU another process takes is time they do not get.
CONTROL_PLANE = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler")


def control_plane_cpu(cp: ControlPlane) -> dict[str, float]:
    """CPU seconds so far of each control-plane process (for a phase's delta)."""
    out = {}
    for name in CONTROL_PLANE:
        proc = cp.procs.get(name)
        if proc is not None and proc.popen is not None and proc.alive():
            out[name] = cpu_seconds(proc.popen.pid)
    return out


#: The API server's own counters a phase reports (sums over their other labels): what its CPU
#: went to, which the requests of the clients alone do not show (watch events sent to every
#: watcher, time in API Priority and Fairness queues by priority level).
APISERVER_SERIES = {
    "apiserver_request_total": ("verb", "resource", "subresource"),
    "apiserver_request_duration_seconds_sum": ("verb", "resource", "subresource"),
    "apiserver_watch_events_total": ("kind", "resource"),  # by kind or resource, as the version names it
    "apiserver_watch_events_sizes_sum": ("kind", "resource"),
    "apiserver_flowcontrol_request_wait_duration_seconds_sum": ("priority_level",),
    "apiserver_flowcontrol_request_execution_seconds_sum": ("priority_level",),
}


def apiserver_metrics(cp: ControlPlane) -> dict[str, float]:
    """``name{label values}`` -> value, summed over the labels not named in APISERVER_SERIES."""
    code, text = cp.raw("/metrics", timeout=60)
    out: dict[str, float] = {}
    if code != 200:
        return out
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name not in APISERVER_SERIES:
            continue
        labels_text, _, value = rest.rpartition("} ")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', labels_text))
        key = name + "{" + ",".join(labels.get(k, "") for k in APISERVER_SERIES[name]) + "}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def metrics_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What changed, rounded; zero deltas left out."""
    out = {k: round(v - before.get(k, 0.0), 2) for k, v in sorted(after.items())}
    return {k: v for k, v in out.items() if v}


def cpu_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 1) for k, v in after.items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0)) for k, v in sorted(after.items()) if v - before.get(k, 0)}


def start_coordinator(cp: ControlPlane, workers: int, log_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig_for("modelcache-system", "modelcache-coordinator",
                                                             seconds=24 * 3600))}
    log = open(log_path, "wb")  # noqa: SIM115 (the process holds it; closed with the directory)
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "--no-leader-election", "--bind", "127.0.0.1", "--port",
         str(port), "--workers", str(workers), "--log-level", "WARNING", "--no-mutate-isvc"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
                if resp.status == 200:
                    return proc, port
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"coordinator did not get ready:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


class ApiserverProfile:
    """The API server's own CPU profile (Go pprof, ``/debug/pprof/profile``) over the first
    ``seconds`` of a phase, fetched as the admin into ``out`` (``go tool pprof -top out``): where
    the API server's CPU goes in each phase, side by side (it is most of both phases' CPU). Needs
    the API server started with ``--profiling=true`` (tests/cluster turns it off)."""

    def __init__(self, cp: ControlPlane, out: Path, seconds: int) -> None:
        self.error: str | None = None

        def fetch() -> None:
            req = urllib.request.Request(f"{cp.server}/debug/pprof/profile?seconds={seconds}")
            try:
                with urllib.request.urlopen(req, timeout=seconds + 120, context=cp.ssl_context()) as resp:
                    out.write_bytes(resp.read())
            except OSError as exc:  # reported in the results, the phase's figures still stand
                self.error = f"{out.name}: {exc}"

        self._thread = threading.Thread(target=fetch, name="apiserver-profile", daemon=True)
        self._thread.start()

    def wait(self) -> str | None:
        self._thread.join()
        return self.error


def creation_order(caches: int, groups: int, by_group: bool) -> list[int]:
    """The caches in the order they are created (cache c is of group c % groups): round robin over
    the groups, or ``by_group``: all of g0's, then g1's (a directory applied in name order), where
    a group's nodes are not held before its first cache arrives."""
    return sorted(range(caches), key=lambda c: c % groups) if by_group else list(range(caches))


def coordinator_run(cp: ControlPlane, kube: Kube, nodes: int, groups: int, caches: int, workers: int,
                    quiet: float, timeout: float, log_path: Path,
                    converged_hook: Callable[[], None] | None = None, by_group: bool = False,
                    profile: Path | None = None, api_profile: Callable[[str], ApiserverProfile] | None = None,
                    ) -> dict[str, Any]:
    members = {g: len(range(g, nodes, groups)) for g in range(groups)}
    # The caches' copies, from a watch: a list every 2 s (200 caches with 1,000 members'
    # nodeStatus: 2-7 MB each time, up to 2.5 GB over the 724 s 10,000-node run) was load on the API server
    # and this process that the baseline does not carry, and was cut at load 20.
    watched = Informer(kube, LOCAL_MODEL_CACHES, watch_timeout=600, transform=cache_copies).start()
    if not watched.wait_for_sync(120):
        raise SystemExit("the caches' watch did not sync in 120 s")
    proc, port = start_coordinator(cp, workers, log_path)
    try:
        idle = rss(proc.pid)
        requests0, writes0 = coordinator_metrics(port)
        cpu0 = cpu_seconds(proc.pid)
        cp_cpu0, api0 = control_plane_cpu(cp), apiserver_metrics(cp)
        spy = profiler.start_py_spy(proc.pid, profile, rate=20) if profile else None
        api_spy = api_profile("coordinator") if api_profile else None
        load = os.getloadavg()[0]
        start = time.monotonic()
        for c in creation_order(caches, groups, by_group):
            retried(f"cache {c}", lambda c=c: make_cache(kube, cache_name(c), cache_uri(c), [f"g{c % groups}"]))
        created_s = time.monotonic() - start
        progress(f"{caches} caches created in {created_s:.1f} s")

        def converged() -> bool:
            items = watched.store.list(copy_objects=False)
            done = 0
            for item in items:
                want = members[int(item["spec"]["nodeGroups"][0][1:])]
                copies = (item.get("status") or {}).get("copies") or {}
                done += copies.get("available") == want and copies.get("total") == want
            return len(items) == caches and done == caches

        while not converged():
            if time.monotonic() - start > timeout or proc.poll() is not None:
                raise SystemExit(f"did not converge:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        available_s = time.monotonic() - start
        progress(f"caches available after {available_s:.0f} s; waiting for the coordinator's last request")
        # Converged = the coordinator is done too: its last request before 10 s without any.
        (last, last_writes), last_change = coordinator_metrics(port), time.monotonic()
        last_cpu = cpu_seconds(proc.pid)
        last_cp_cpu = control_plane_cpu(cp)
        while time.monotonic() - last_change < 10:
            time.sleep(1)
            now, now_writes = coordinator_metrics(port)
            if {k: v for k, v in now.items() if k != "WATCH"} != {k: v for k, v in last.items() if k != "WATCH"}:
                last, last_writes, last_change = now, now_writes, time.monotonic()
                last_cpu = cpu_seconds(proc.pid)
                last_cp_cpu = control_plane_cpu(cp)
            if time.monotonic() - start > timeout:
                raise SystemExit("the coordinator never settled")
        converge_s = last_change - start
        api_end = apiserver_metrics(cp)  # 10 s after the last request: what it did for them, and idle
        end_load = os.getloadavg()[0]
        if spy is not None:
            profiler.stop(spy)
            spy = None
        if converged_hook is not None:
            converged_hook()
        api_profile_error = api_spy.wait() if api_spy else None
        before, _ = coordinator_metrics(port)
        time.sleep(quiet)
        after, _ = coordinator_metrics(port)
        quiet_by_verb = delta(after, before)
        mem = rss(proc.pid)
        to_converge = delta(last, requests0)
        written = delta(last_writes, writes0)
        return {
            "caches_created_seconds": round(created_s, 1),
            "caches_available_seconds": round(available_s, 1), "converge_seconds": round(converge_s, 1),
            "requests_to_converge": to_converge,
            "writes_to_converge": {k: v for k, v in written.items() if not k.startswith("reconcile")},
            "reconciles_to_converge": {k.removeprefix("reconcile "): v for k, v in written.items()
                                       if k.startswith("reconcile")},
            "control_plane_cpu_seconds": cpu_delta(last_cp_cpu, cp_cpu0),
            "apiserver": metrics_delta(api_end, api0),
            "requests_at_start": {k: int(v) for k, v in sorted(requests0.items())},
            "cpu_seconds": round(last_cpu - cpu0, 1),
            "quiet_seconds": quiet,
            "quiet_requests": sum(v for k, v in quiet_by_verb.items() if k != "WATCH"),
            "quiet_requests_by_verb": quiet_by_verb, "quiet_watches_reopened": quiet_by_verb.get("WATCH", 0),
            "rss_idle_mib": idle["VmRSS"], "peak_rss_mib": mem["VmHWM"], "rss_end_mib": mem["VmRSS"],
            "load_average": [round(load, 1), round(end_load, 1)],
            **({"apiserver_profile_error": api_profile_error} if api_profile_error else {}),
        }
    finally:
        if spy is not None:
            profiler.stop(spy)
        watched.stop()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(cp: ControlPlane, nodes: int, groups: int, caches: int, workers: int, quiet: float, timeout: float,
            workdir: Path, by_group: bool = False, profile: Path | None = None,
            api_profile: Callable[[str], ApiserverProfile] | None = None) -> dict[str, Any]:
    """Both phases on ``cp`` (a control plane with nothing of ours on it yet)."""
    apply_manifests(cp)
    kube = Kube(load_api_client(str(cp.kubeconfig)))
    started = time.monotonic()
    for g in range(groups):
        make_group(kube, f"g{g}", label_value=f"pool{g}")
    progress(f"creating {nodes} Nodes")
    make_nodes(kube, nodes, groups)
    setup_s = time.monotonic() - started
    agents = Agents(Kube(load_api_client(str(cp.kubeconfig)))).start()
    try:
        progress(f"Nodes created in {setup_s:.0f} s; baseline")
        cp_cpu0, bench_cpu0, api0 = control_plane_cpu(cp), time.process_time(), apiserver_metrics(cp)
        api_spy = api_profile("baseline") if api_profile else None
        base = baseline(str(cp.kubeconfig), agents, nodes, groups, caches, workers, timeout)
        # to its last label, within a second or two (what the API server did for it)
        base["control_plane_cpu_seconds"] = cpu_delta(control_plane_cpu(cp), cp_cpu0)
        base["apiserver"] = metrics_delta(apiserver_metrics(cp), api0)
        base["bench_process_cpu_seconds"] = round(time.process_time() - bench_cpu0, 1)
        base["agent_status_patches"] = agents.patches
        if api_spy is not None and (error := api_spy.wait()):
            base["apiserver_profile_error"] = error
        progress(f"baseline {base['seconds']} s; removing what it wrote")
        undo_baseline(cp, kube, agents, nodes, groups, caches)
        progress("coordinator")
        bench_cpu0 = time.process_time()
        run = coordinator_run(cp, kube, nodes, groups, caches, workers, quiet, timeout, workdir / "coordinator.log",
                              by_group=by_group, profile=profile, api_profile=api_profile)
        run["bench_process_cpu_seconds"] = round(time.process_time() - bench_cpu0, 1)
        run["agent_status_patches"] = agents.patches
    finally:
        agents.stop()
    requests = sum(run["requests_to_converge"].values())
    return {
        "nodes": nodes, "groups": groups, "caches": caches, "workers": workers,
        "cache_order": "by group" if by_group else "round robin", "setup_seconds": round(setup_s, 1),
        "converge_seconds": run["converge_seconds"], "baseline_seconds": base["seconds"],
        "converge_vs_baseline": round(run["converge_seconds"] / max(base["seconds"], 0.1), 2),
        "requests_per_node": round(requests / nodes, 2),
        "baseline_requests_per_node": round(sum(base["requests"].values()) / nodes, 2),
        "cpu_seconds_per_1000_nodes": round(run["cpu_seconds"] / nodes * 1000, 1),
        "peak_rss_mib": run["peak_rss_mib"], "quiet_requests": run["quiet_requests"],
        "coordinator": run, "baseline": base,
    }


def table_row(r: dict[str, Any]) -> str:
    met = {k: ("met" if r[k] <= v else "**missed**") for k, v in TARGETS.items()}
    c = r["coordinator"]
    return (f"| {r['nodes']:,} nodes, {r['groups']} groups, {r['caches']} caches | {r['converge_seconds']} s | "
            f"{r['baseline_seconds']} s | {r['converge_vs_baseline']} ({met['converge_vs_baseline']}) | "
            f"{r['requests_per_node']} ({met['requests_per_node']}) | {r['cpu_seconds_per_1000_nodes']} | "
            f"{r['peak_rss_mib']} MiB ({met['peak_rss_mib']}) | "
            f"{r['quiet_requests']} in {c['quiet_seconds']:.0f} s ({met['quiet_requests']}) | "
            f"{c['load_average'][0]}-{c['load_average'][1]} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=10000)
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--caches", type=int, default=200)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--quiet", type=float, default=60, help="seconds of the at-rest window")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path, help="write the result here too")
    ap.add_argument("--by-group", action="store_true", help="create the caches group by group, not round robin")
    ap.add_argument("--profile", type=Path, help="py-spy the coordinator from its first cache to convergence "
                    "into this file (collapsed stacks; py-spy from PY_SPY or PATH)")
    ap.add_argument("--apiserver-profile", type=Path, metavar="PREFIX",
                    help="the API server's CPU profile over each phase's first --apiserver-profile-seconds, "
                    "into PREFIX-baseline.pprof and PREFIX-coordinator.pprof (go tool pprof -top)")
    ap.add_argument("--apiserver-profile-seconds", type=int, default=90)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="coordinator-scale-") as tmp:
        cp = ControlPlane(Path(tmp) / "cluster", bin_dir=ensure_binaries(),
                          apiserver_args=("--profiling=true",) if args.apiserver_profile else ()).start()
        prefix: Path | None = args.apiserver_profile

        def api_profile(phase: str) -> ApiserverProfile:
            assert prefix is not None
            out = prefix.with_name(f"{prefix.name}-{phase}.pprof")
            return ApiserverProfile(cp, out, args.apiserver_profile_seconds)

        try:
            result = measure(cp, args.nodes, args.groups, args.caches, args.workers, args.quiet, args.timeout,
                             Path(tmp), by_group=args.by_group, profile=args.profile,
                             api_profile=api_profile if prefix else None)
        finally:
            cp.stop()
    result["load_average_end"] = round(os.getloadavg()[0], 1)
    text = json.dumps(result)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    print(table_row(result))


if __name__ == "__main__":
    main()
