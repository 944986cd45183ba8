"""Coordinator at scale on the real control plane (tests/cluster): convergence time and API traffic at rest.

500 nodes in 3 node groups, 50 caches; the agents are simulated by one loop that marks every
entry ModelDownloaded. Measures (1) seconds from creating all caches until every cache shows
all its members NodeDownloaded, and (2) the coordinator's API requests while every controller
reconciles every key once more with nothing changed (what a resync period does): the target is
zero writes and zero reads (reads are served by the informers; only the open watches remain).

    .venv/bin/python bench/coordinator_scale.py [--nodes 500] [--groups 3] [--caches 50]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from coordinator.app import Config, Coordinator  # noqa: E402
from modelcache.kube.client import LOCAL_MODEL_CACHES, LOCAL_MODEL_NODES, Kube, load_api_client  # noqa: E402
from tests.cluster.baseline import apply_manifests  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.coordinator_util import make_cache, make_group, make_node  # noqa: E402
from tests.helpers import free_port  # noqa: E402


class RequestCounter:
    """Counts the HTTP requests one ApiClient sends, by method (watch GETs counted apart)."""

    def __init__(self, kube: Kube) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.paths: collections.Counter[str] = collections.Counter()  # method + path without the name
        self._lock = threading.Lock()
        pool = kube.api_client.rest_client.pool_manager
        original = pool.request

        def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
            kind = "WATCH" if method == "GET" and "watch=" in url else method
            with self._lock:
                self.counts[kind] += 1
                self.paths[f"{kind} {url.split('?')[0].rsplit('/', 1)[0].split('/', 3)[-1]}"] += 1
            return original(method, url, *args, **kwargs)

        pool.request = request  # type: ignore[method-assign]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def path_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.paths)


def simulate_agents(kube: Kube, stop: threading.Event) -> None:
    """Every entry becomes ModelDownloaded (one LIST per round, one status patch per changed node)."""
    while not stop.is_set():
        for lmn in kube.list(LOCAL_MODEL_NODES).get("items") or []:
            want = {(f"{m['namespace']}/{m['modelName']}" if m.get("namespace") else m["modelName"]): "ModelDownloaded"
                    for m in (lmn.get("spec") or {}).get("localModels") or []}
            have = (lmn.get("status") or {}).get("modelStatus") or {}
            if have != want:
                patch = {k: None for k in have if k not in want}
                patch.update(want)
                kube.patch_status(LOCAL_MODEL_NODES, lmn["metadata"]["name"], {"status": {"modelStatus": patch}})
        stop.wait(0.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--caches", type=int, default=50)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="coordinator-scale-") as tmp:
        api = ControlPlane(Path(tmp) / "cluster").start()
        try:
            apply_manifests(api)
            kube = Kube(load_api_client(str(api.kubeconfig)))
            for g in range(args.groups):
                make_group(kube, f"g{g}", label_value=f"pool{g}")
            for n in range(args.nodes):
                make_node(kube, f"node-{n:04d}", **{"kserve/localmodel": f"pool{n % args.groups}"})
            members = collections.Counter(n % args.groups for n in range(args.nodes))

            coord_kube = Kube(load_api_client(str(api.kubeconfig)))
            counter = RequestCounter(coord_kube)
            cfg = Config(kubeconfig=str(api.kubeconfig), leader_election=False, host="127.0.0.1", port=free_port(),
                         workers=args.workers, watch_timeout=600)
            coord = Coordinator(cfg, coord_kube).start()
            stop = threading.Event()
            agents = threading.Thread(target=simulate_agents, args=(Kube(load_api_client(str(api.kubeconfig))), stop),
                                      daemon=True)
            agents.start()
            while not coord.controllers_running.is_set():
                time.sleep(0.05)

            start = time.monotonic()
            for c in range(args.caches):
                make_cache(kube, f"cache-{c:03d}", f"s3://models/m{c}", [f"g{c % args.groups}"])

            def converged() -> bool:
                for item in kube.list(LOCAL_MODEL_CACHES).get("items") or []:
                    group = int(item["spec"]["nodeGroups"][0][1:])
                    copies = (item.get("status") or {}).get("copies") or {}
                    if copies.get("available") != members[group] or copies.get("total") != members[group]:
                        return False
                return True

            while not converged():
                if time.monotonic() - start > args.timeout:
                    raise SystemExit("did not converge")
                time.sleep(0.5)
            converge_s = time.monotonic() - start
            stop.set()
            agents.join(10)
            time.sleep(3)  # let the last events drain

            before, before_paths = counter.snapshot(), counter.path_snapshot()
            keys = 0
            for ctl in coord.manager.controllers:
                for inf in ctl.informers[:1]:  # the controller's own kind
                    for key in inf.store.keys():  # noqa: SIM118 (Store is not a dict)
                        ctl.queue.add(key)
                        keys += 1
            while any(len(ctl.queue) or ctl.queue._processing for ctl in coord.manager.controllers):
                time.sleep(0.1)
            time.sleep(1)
            after = counter.snapshot()
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
            after_paths = counter.path_snapshot()
            path_delta = {k: v - before_paths.get(k, 0) for k, v in after_paths.items() if v - before_paths.get(k, 0)}
            coord.stop()
            print(json.dumps({
                "nodes": args.nodes, "groups": args.groups, "caches": args.caches, "workers": args.workers,
                "converge_seconds": round(converge_s, 1), "requests_to_converge": before,
                "resync_keys_reconciled": keys,
                "resync_requests": {k: v for k, v in sorted(delta.items()) if v},
                "resync_requests_by_path": path_delta,
                "resync_writes": sum(v for k, v in delta.items() if k in ("POST", "PUT", "PATCH", "DELETE")),
            }))
        finally:
            api.stop()


if __name__ == "__main__":
    main()
