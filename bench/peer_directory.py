"""The agents' peer directory at scale: what one node's status change costs the API server, and
what each agent keeps, with every agent watching every LocalModelNode (before) and with each
watching only its node groups' (after: agent/peering.Directory.scope, by the
``nodegroup.modelcache.io/<group>`` labels the coordinator writes with the entries).

On one real control plane (tests/cluster), ``--nodes`` LocalModelNodes in groups of
``--group-size`` (labelled and with entries as the coordinator writes them, each with a peer
endpoint in its status). ``--watchers`` agents' directories are simulated in this process: each is
the agent's own ``Directory`` class (its informers: a list, then a watch connection each, on the
API server's watch cache), for nodes spread evenly over the groups. Both phases, one after the
other on the same server and the same objects:

1. **before**: every directory watches every LocalModelNode (``scope(None)``, what an agent did
   before, and still does for entries that name no node group);
2. **after**: each directory watches its node's group (``scope({group})``).

In each phase ``--changes`` status writes (one node's ``modelDetails``, as an agent reports
progress, on nodes taken in turn from every group) are made once every directory is synced. The
API server's own counters (``apiserver_watch_events_total`` and ``apiserver_watch_events_sizes``
for LocalModelNodes, from its /metrics) give the watch events and bytes it sent per change (these
include the control plane's own watcher of every resource, the garbage collector's: one event
per change); the directories' stores give the objects each keeps. Printed: a table and (``--json``) the figures.

    .venv/bin/python bench/peer_directory.py [--nodes 1000] [--group-size 20] [--watchers 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.peering import Directory  # noqa: E402
from modelcache.kube.client import LOCAL_MODEL_NODES, Kube, load_api_client  # noqa: E402
from modelcache.kube.types import node_group_label  # noqa: E402
from modelcache.sources.uri import storage_key  # noqa: E402
from tests.cluster.baseline import apply_manifests  # noqa: E402
from tests.cluster.build import ensure_binaries  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402

URI = "s3://models/llm"
KEY = storage_key(URI)
#: The API server's watch counters (labels differ by version: kind=, or group= and resource=).
EVENTS = re.compile(r'^apiserver_watch_events_total\{([^}]*)\} (\S+)$', re.M)
SIZES = re.compile(r'^apiserver_watch_events_sizes_sum\{([^}]*)\} (\S+)$', re.M)


def node_name(n: int) -> str:
    return f"node-{n:05d}"


def group_of(n: int, group_size: int) -> str:
    return f"g{n // group_size:04d}"


def watch_counters(cp: ControlPlane) -> tuple[float, float]:
    """(watch events, their bytes) the API server sent for LocalModelNodes, since it started."""
    code, text = cp.raw("/metrics", timeout=60)
    if code != 200:
        raise SystemExit(f"API server /metrics: HTTP {code}")

    def total(pattern: re.Pattern[str]) -> float:
        return sum(float(v) for labels, v in pattern.findall(text) if "localmodelnode" in labels.lower()
                   and "localmodelnodegroup" not in labels.lower())

    return total(EVENTS), total(SIZES)


def make_nodes(kube: Kube, nodes: int, group_size: int) -> None:
    def one(n: int) -> None:
        group = group_of(n, group_size)
        name = node_name(n)
        kube.create(LOCAL_MODEL_NODES, {
            "metadata": {"name": name, "labels": {node_group_label(group): "true"}},
            "spec": {"localModels": [{"modelName": "llm", "sourceModelUri": URI, "nodeGroup": group}]}})
        kube.patch_status(LOCAL_MODEL_NODES, name, {"status": {
            "modelStatus": {"llm": "ModelDownloading"},
            "peer": {"endpoint": f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}:8471", "certSHA256": "ab" * 32,
                     "zone": "zone-a"}}})

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(nodes)))


def watchers_of(nodes: int, group_size: int, watchers: int) -> list[int]:
    """``watchers`` nodes spread evenly over the groups (round-robin, then the next member)."""
    groups = (nodes + group_size - 1) // group_size
    out: list[int] = []
    for i in range(watchers):
        g, k = i % groups, i // groups
        n = g * group_size + k
        if n < nodes and k < group_size:
            out.append(n)
    return out


def phase(cp: ControlPlane, kube: Kube, name: str, nodes: int, group_size: int, watchers: list[int],
          changes: int, timeout: float) -> dict[str, Any]:
    dirs = []
    started = time.monotonic()
    for n in watchers:
        d = Directory(kube, node_name(n), sync_wait=0)
        d.scope(None if name == "before" else frozenset({group_of(n, group_size)}))
        dirs.append(d)
    try:
        informers = [i for d in dirs for i in ([d.informer] if d.groups is None else list(d.scoped.values()))]
        deadline = time.monotonic() + timeout
        for i in informers:
            if not i.wait_for_sync(max(0.0, deadline - time.monotonic())):
                raise SystemExit(f"{name}: a directory did not sync in {timeout:.0f} s")
        sync_s = time.monotonic() - started
        objects = [len(d.objects()) for d in dirs]
        kept_bytes = [sum(len(json.dumps(o)) for o in d.objects()) for d in dirs]
        time.sleep(2)  # let the initial events settle before counting
        events0, bytes0 = watch_counters(cp)
        groups = (nodes + group_size - 1) // group_size
        changed = [(i % groups) * group_size + (i // groups) % group_size for i in range(changes)]
        changed = [n for n in changed if n < nodes]
        last: dict[str, str] = {}
        seq = int(time.time() * 1000)  # a new value in each phase (an unchanged status is no write)
        for i, n in enumerate(changed):
            obj = kube.patch_status(LOCAL_MODEL_NODES, node_name(n), {"status": {"modelDetails": {
                "llm": {"storageKey": KEY, "state": "ModelDownloading", "bytesDone": seq + i}}}})
            last[node_name(n)] = obj["metadata"]["resourceVersion"]
        # Wait until every directory that should see a change has (the last version written).
        while time.monotonic() < deadline:
            late = sum(1 for d in dirs for obj in d.objects()
                       if obj["metadata"]["name"] in last
                       and obj["metadata"].get("resourceVersion") != last[obj["metadata"]["name"]])
            if not late:
                break
            time.sleep(0.5)
        time.sleep(2)  # the counters are updated as events are sent
        events1, bytes1 = watch_counters(cp)
    finally:
        for d in dirs:
            d.stop()
    watching = [sum(1 for n in watchers if name == "before" or group_of(n, group_size) == group_of(c, group_size))
                for c in changed]
    return {
        "watch_connections": len(informers), "sync_seconds": round(sync_s, 1),
        "status_changes": len(changed),
        "watch_events_per_change": round((events1 - events0) / len(changed), 2),
        "watch_bytes_per_change": round((bytes1 - bytes0) / len(changed)),
        "watchers_interested_per_change": round(sum(watching) / len(changed), 2),
        "objects_per_directory": max(objects), "bytes_per_directory": max(kept_bytes),
        "counters": {"events": [events0, events1], "bytes": [bytes0, bytes1]},
        "informers": {k: sum(i.stats[k] for i in informers) for k in ("lists", "watches", "relists", "errors")},
    }


def measure(cp: ControlPlane, nodes: int, group_size: int, watchers: int, changes: int,
            timeout: float = 600) -> dict[str, Any]:
    apply_manifests(cp)
    kube = Kube(load_api_client(str(cp.kubeconfig)))
    make_nodes(kube, nodes, group_size)
    who = watchers_of(nodes, group_size, watchers)
    load = round(os.getloadavg()[0], 1)
    before = phase(cp, kube, "before", nodes, group_size, who, changes, timeout)
    after = phase(cp, kube, "after", nodes, group_size, who, changes, timeout)
    return {"nodes": nodes, "group_size": group_size, "watchers": len(who), "changes": changes,
            "before": before, "after": after,
            "events_ratio": round(after["watch_events_per_change"] / max(before["watch_events_per_change"], 1e-9), 4),
            "bytes_ratio": round(after["watch_bytes_per_change"] / max(before["watch_bytes_per_change"], 1), 4),
            "load_average": [load, round(os.getloadavg()[0], 1)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--group-size", type=int, default=20)
    ap.add_argument("--watchers", type=int, default=200, help="agents' directories simulated (one per node)")
    ap.add_argument("--changes", type=int, default=100, help="status writes per phase")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="peer-directory-") as tmp:
        cp = ControlPlane(Path(tmp) / "cluster", bin_dir=ensure_binaries()).start()
        try:
            out = measure(cp, args.nodes, args.group_size, args.watchers, args.changes, args.timeout)
        finally:
            cp.stop()
    text = json.dumps(out)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    print(f"{out['nodes']} LocalModelNodes in groups of {out['group_size']}, {out['watchers']} directories, "
          f"{out['changes']} status changes a phase, load average {out['load_average']}")
    print("| directory | watch connections | watch events per status change | bytes per change | "
          "objects kept per agent | bytes kept per agent |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ("before", "after"):
        r = out[name]
        print(f"| {name} | {r['watch_connections']} | {r['watch_events_per_change']} | {r['watch_bytes_per_change']} | "
              f"{r['objects_per_directory']} | {r['bytes_per_directory']} |")


if __name__ == "__main__":
    main()
