"""Chaos: two agents and two coordinator replicas on the real control plane while the cluster
changes at random, then every node must tell the truth (issue 21).

For ``CHAOS_SECONDS`` (75 by default; ``make chaos`` runs 15 minutes) a seeded random sequence
of steps runs: caches created, deleted, re-created with another URI, moved between node groups;
nodes relabelled in and out of groups and groups' selectors edited; groups replaced with
``kubectl replace --force``; Nodes deleted and registered again; agents killed (SIGKILL or
SIGTERM) and restarted; the coordinator holding the Lease killed and started again. Then
everything is brought back up and, once the system has settled, for every node:
- status equals what is on disk: every spec entry ModelDownloaded with its storageKey, and that
  model present and verified (every file re-hashed against its manifest); no other status key;
  nothing on disk that no entry wants; ``status.nodeUID`` is the Node's;
- every ``downloaded.modelcache.io/`` label names an entry's model, verified on that node;
- no model that a cache wanted all along was deleted: the ``anchor`` cache's group is only
  ever replaced and its nodes only deleted and re-registered, so its folder must be the very
  same (inode) at the end and no agent may have logged deleting it;
- nothing is left in staging (no partial download, no trash) nor in the repair folder.
And all through the chaos a sampler checks that no label and no ModelDownloaded status ever
names a model that is not on the node's disk (see ``Sampler``).

The seed is printed first; ``CHAOS_SEED=<seed> make chaos`` replays the same sequence of steps
(timing still differs from run to run).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from coordinator.nodelabels import LABEL_PREFIX, model_label
from modelcache.kube.client import (
    LEASES,
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    LOCAL_MODEL_NODES,
    NODES,
    Kube,
    load_api_client,
)
from modelcache.kube.types import status_key
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.agent_util import AgentProc, start_agent
from tests.coordinator_util import GROUP_LABEL, group_manifest, make_group
from tests.fixtures.cluster import Cluster
from tests.helpers import REPO, free_port, stop_process, wait_until

CHAOS_SECONDS = float(os.environ.get("CHAOS_SECONDS") or 75)
SETTLE_SECONDS = float(os.environ.get("CHAOS_SETTLE_SECONDS") or 240)
NODE_NAMES = ("chaos-1", "chaos-2")
POOLS = ("gpu", "cpu")
CACHES = ("c1", "c2", "c3", "c4")
ANCHOR = "anchor"
LEASE = ("--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5")

pytestmark = pytest.mark.timeout(int(CHAOS_SECONDS + SETTLE_SECONDS + 240))


@dataclass
class Coordinators:
    """Two coordinator replicas as processes (leader election on the deploy/ Lease)."""

    cluster: Cluster
    workdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # identity -> process
    logs: list[Path] = field(default_factory=list)
    started: int = 0

    def start(self) -> str:
        self.started += 1
        identity = f"coord-{self.started}"
        log = self.workdir / f"{identity}.log"
        env = {**os.environ, "KUBECONFIG": str(self.cluster.coordinator_kubeconfig), "POD_NAME": identity,
               "POD_NAMESPACE": "modelcache-system"}
        cmd = [sys.executable, "-m", "coordinator", "--bind", "127.0.0.1", "--port", str(free_port()), *LEASE]
        with open(log, "wb") as out:
            self.procs[identity] = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.logs.append(log)
        return identity

    def reap(self) -> None:
        """Replicas that exited (a deposed leader exits) are replaced, as a Deployment would."""
        for identity, proc in list(self.procs.items()):
            if proc.poll() is not None:
                del self.procs[identity]
                self.start()

    def kill_leader(self, kube: Kube) -> str | None:
        lease = kube.get_or_none(LEASES, "modelcache-coordinator", "modelcache-system") or {}
        holder = (lease.get("spec") or {}).get("holderIdentity")
        proc = self.procs.get(holder or "")
        if proc is None:
            return None
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        return holder

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process(proc)


@dataclass
class Agents:
    cluster: Cluster
    workdir: Path
    running: dict[str, AgentProc] = field(default_factory=dict)
    logs: dict[str, list[AgentProc]] = field(default_factory=dict)

    def root(self, node: str) -> Path:
        return self.workdir / f"root-{node}"

    def start(self, node: str) -> None:
        agent = start_agent(self.cluster.agent_kubeconfig, node, self.root(node), self.workdir,
                            "--sweep-interval", "2", "--max-concurrent-models", "2")
        self.running[node] = agent
        self.logs.setdefault(node, []).append(agent)

    def kill(self, node: str, hard: bool) -> None:
        agent = self.running.pop(node, None)
        if agent is None:
            return
        if hard:
            agent.kill9()
        else:
            agent.stop()

    def log_text(self, node: str) -> str:
        return "\n".join(a.log() for a in self.logs.get(node, []))

    def stop(self) -> None:
        for agent in self.running.values():
            agent.stop()


@dataclass
class World:
    """What the chaos did, so the end state can be checked and restored."""

    kube: Kube
    cluster: Cluster
    rng: random.Random
    uris: list[str]
    anchor_uri: str
    pools: dict[str, str | None] = field(default_factory=dict)  # node -> pool label
    node_up: dict[str, bool] = field(default_factory=dict)
    pending: list[tuple[float, str, Callable[[], None]]] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)

    def later(self, delay: float, what: str, action: Callable[[], None]) -> None:
        self.pending.append((time.monotonic() + delay, what, action))

    def run_due(self) -> None:
        now = time.monotonic()
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _when, what, action in due:
            self.steps.append(f"{self.clock()} {what}")
            try:
                action()
            except Exception as exc:  # racing another change (a 404, a 409): part of the chaos
                self.steps.append(f"{self.clock()} {what}: {type(exc).__name__}")

    def clock(self) -> str:
        return time.strftime("%H:%M:%S")


def group_body(name: str, affinity: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNodeGroup", "metadata": {"name": name},
            "spec": {"storageLimit": "10Gi",
                     "persistentVolumeSpec": {"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "10Gi"},
                                              "local": {"path": "/models"}, "storageClassName": "local-storage",
                                              "nodeAffinity": {"required": {"nodeSelectorTerms": [affinity]}}},
                     "persistentVolumeClaimSpec": {"accessModes": ["ReadWriteOnce"],
                                                   "resources": {"requests": {"storage": "10Gi"}},
                                                   "storageClassName": "local-storage"}}}


def stable_group() -> dict[str, Any]:
    return group_body("stable", {"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": list(NODE_NAMES)}]})


def cache_body(name: str, uri: str, groups: list[str]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"sourceModelUri": uri, "modelSize": "2Mi", "nodeGroups": groups}}


# ---- the steps -------------------------------------------------------------------------------


def step_cache_create(w: World) -> str:
    name = w.rng.choice(CACHES)
    if w.kube.get_or_none(LOCAL_MODEL_CACHES, name) is not None:
        return f"create {name}: exists"
    uri, groups = w.rng.choice(w.uris), w.rng.sample(["gpu", "cpu", "stable"], w.rng.randint(1, 2))
    w.kube.create(LOCAL_MODEL_CACHES, cache_body(name, uri, groups))
    return f"create {name} {uri.rsplit('/', 1)[-1]} on {groups}"


def step_cache_delete(w: World) -> str:
    name = w.rng.choice(CACHES)
    if w.kube.get_or_none(LOCAL_MODEL_CACHES, name) is None:
        return f"delete {name}: absent"
    w.kube.delete(LOCAL_MODEL_CACHES, name)
    return f"delete {name}"


def step_cache_recreate(w: World) -> str:
    """E4: the same name back with another URI as soon as the old one is finalized."""
    name, uri = w.rng.choice(CACHES), w.rng.choice(w.uris)
    old = w.kube.get_or_none(LOCAL_MODEL_CACHES, name)
    if old is None:
        return f"recreate {name}: absent"
    groups = list(old["spec"]["nodeGroups"])
    w.kube.delete(LOCAL_MODEL_CACHES, name)

    def create() -> None:
        current = w.kube.get_or_none(LOCAL_MODEL_CACHES, name)
        if current is None:
            w.kube.create(LOCAL_MODEL_CACHES, cache_body(name, uri, groups))
        elif current["metadata"].get("deletionTimestamp"):
            w.later(1.0, f"recreate {name} (still finalizing)", create)

    w.later(0.5, f"recreate {name} -> {uri.rsplit('/', 1)[-1]}", create)
    return f"recreate {name}: deleting"


def step_cache_move(w: World) -> str:
    name = w.rng.choice(CACHES)
    cache = w.kube.get_or_none(LOCAL_MODEL_CACHES, name)
    if cache is None or cache["metadata"].get("deletionTimestamp"):
        return f"move {name}: absent"
    groups = w.rng.sample(["gpu", "cpu", "stable"], w.rng.randint(1, 2))
    w.kube.patch(LOCAL_MODEL_CACHES, name, {"spec": {"nodeGroups": groups}})
    return f"move {name} to {groups}"


def step_node_relabel(w: World) -> str:
    node = w.rng.choice(NODE_NAMES)
    pool = w.rng.choice([*POOLS, None])
    w.pools[node] = pool
    if w.node_up.get(node):
        w.kube.patch(NODES, node, {"metadata": {"labels": {GROUP_LABEL: pool}}})
    return f"relabel {node} pool={pool}"


def step_group_selector(w: World) -> str:
    values = w.rng.choice([["gpu"], ["gpu", "cpu"]])
    group = w.kube.get_or_none(LOCAL_MODEL_NODE_GROUPS, "gpu")
    if group is None:
        return "gpu selector: group absent"
    terms = [{"matchExpressions": [{"key": GROUP_LABEL, "operator": "In", "values": values}]}]
    group["spec"]["persistentVolumeSpec"]["nodeAffinity"]["required"]["nodeSelectorTerms"] = terms
    w.kube.replace(LOCAL_MODEL_NODE_GROUPS, group)
    return f"gpu group selects {values}"


def step_group_replace(w: World) -> str:
    name = w.rng.choice(["stable", "gpu", "cpu"])
    if w.kube.get_or_none(LOCAL_MODEL_NODE_GROUPS, name) is None:
        return f"replace {name}: absent"
    w.cluster.kubectl("replace", "--force", "-f", "-", input=json.dumps(group_manifest(w.kube, name)))
    return f"replace --force group {name}"


def step_group_prune(w: World) -> str:
    """A GitOps prune and re-apply: the group is gone for a few seconds, then back as it was."""
    name = w.rng.choice(["stable", "gpu", "cpu"])
    if w.kube.get_or_none(LOCAL_MODEL_NODE_GROUPS, name) is None:
        return f"prune {name}: absent"
    body = group_manifest(w.kube, name)
    w.kube.delete(LOCAL_MODEL_NODE_GROUPS, name)

    def back() -> None:
        if w.kube.get_or_none(LOCAL_MODEL_NODE_GROUPS, name) is None:
            w.kube.create(LOCAL_MODEL_NODE_GROUPS, body)

    w.later(w.rng.uniform(0.5, 4.0), f"re-apply group {name}", back)
    return f"prune group {name}"


def register(w: World, node: str) -> None:
    pool = w.pools.get(node)
    w.cluster.register_node(node, {GROUP_LABEL: pool} if pool else {})
    w.node_up[node] = True


def step_node_replace(w: World) -> str:
    node = w.rng.choice(NODE_NAMES)
    if not w.node_up.get(node):
        return f"node {node}: already down"
    w.kube.delete(NODES, node)
    w.node_up[node] = False

    def back() -> None:
        old = w.kube.get_or_none(NODES, node)
        if old is not None and old["metadata"].get("deletionTimestamp"):
            w.later(0.5, f"register {node} (old one still being deleted)", back)
            return
        register(w, node)  # (one registered meanwhile gets our labels, as if new: never wait on it forever)

    w.later(w.rng.uniform(0.5, 4.0), f"register {node} again", back)
    return f"delete Node {node}"


def make_step_agent_kill(agents: Agents) -> Callable[[World], str]:
    def step(w: World) -> str:
        node = w.rng.choice(NODE_NAMES)
        if node not in agents.running:
            return f"agent {node}: down"
        hard = w.rng.random() < 0.5
        agents.kill(node, hard)
        w.later(w.rng.uniform(0.5, 5.0), f"start agent {node}", lambda: agents.start(node))
        return f"{'SIGKILL' if hard else 'SIGTERM'} agent {node}"

    return step


def make_step_leader_kill(coordinators: Coordinators) -> Callable[[World], str]:
    def step(w: World) -> str:
        killed = coordinators.kill_leader(w.kube)
        if killed is None:
            return "kill leader: no leader yet"
        del coordinators.procs[killed]
        w.later(w.rng.uniform(0.5, 3.0), "start a coordinator replica", lambda: coordinators.start() and None)
        return f"SIGKILL leader {killed}"

    return step


# ---- the truth -------------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Checks, all through the chaos, what must hold at every moment, not only at the end: a
    ``downloaded.modelcache.io/`` label on a Node, and a ModelDownloaded status for a spec
    entry, each mean the model is on that node's disk now. An object is judged only if it did
    not change while the disk was looked at (same resourceVersion before and after), so a
    violation is a lie someone could have acted on, never a read that raced a legitimate change."""

    def __init__(self, kube: Kube, agents: Agents) -> None:
        super().__init__(name="chaos-sampler", daemon=True)
        self.kube, self.agents = kube, agents
        self.stop = threading.Event()
        self.violations: list[str] = []
        self.samples = 0

    def run(self) -> None:
        while not self.stop.wait(0.3):
            for node in NODE_NAMES:
                try:
                    self.sample(node)
                except Exception:  # the API may be busy or the Node gone: next time
                    continue

    def sample(self, node: str) -> None:
        n0, l0 = self.kube.get_or_none(NODES, node), self.kube.get_or_none(LOCAL_MODEL_NODES, node)
        store = NodeStore.at(self.agents.root(node))
        missing_labels = [k for k in (((n0 or {}).get("metadata") or {}).get("labels") or {})
                          if k.startswith(LABEL_PREFIX) and not store.is_present(k.removeprefix(LABEL_PREFIX))]
        status = (l0 or {}).get("status") or {}
        missing_models = []
        for e in ((l0 or {}).get("spec") or {}).get("localModels") or []:
            skey, key = status_key(e["modelName"], e.get("namespace")), storage_key(e["sourceModelUri"])
            detail = (status.get("modelDetails") or {}).get(skey) or {}
            if (status.get("modelStatus") or {}).get(skey) == "ModelDownloaded" and detail.get("storageKey") == key \
                    and not store.is_present(key):
                missing_models.append(skey)
        n1, l1 = self.kube.get_or_none(NODES, node), self.kube.get_or_none(LOCAL_MODEL_NODES, node)
        self.samples += 1
        when = time.strftime("%H:%M:%S")
        if missing_labels and _rv(n0) == _rv(n1):
            self.violations.append(f"{when} {node}: labels {missing_labels} with no model on disk")
        if missing_models and _rv(l0) == _rv(l1):
            self.violations.append(f"{when} {node}: {missing_models} reported ModelDownloaded, not on disk")


def _rv(obj: dict[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("resourceVersion")


def problems(w: World, agents: Agents, verify: bool) -> list[str]:
    """Everything that differs from the truth right now (empty: consistent)."""
    out: list[str] = []
    for node in NODE_NAMES:
        store = NodeStore.at(agents.root(node))
        node_obj = w.kube.get_or_none(NODES, node)
        lmn = w.kube.get_or_none(LOCAL_MODEL_NODES, node)
        if node_obj is None or lmn is None:
            out.append(f"{node}: Node or LocalModelNode missing")
            continue
        entries = list((lmn.get("spec") or {}).get("localModels") or [])
        status = lmn.get("status") or {}
        states, details = status.get("modelStatus") or {}, status.get("modelDetails") or {}
        wanted = {storage_key(e["sourceModelUri"]) for e in entries}
        keys = {status_key(e["modelName"], e.get("namespace")) for e in entries}
        if set(states) != keys:
            out.append(f"{node}: status keys {sorted(states)} != entries {sorted(keys)}")
        if status.get("nodeUID") != node_obj["metadata"]["uid"]:
            out.append(f"{node}: status.nodeUID {status.get('nodeUID')} is not the Node's")
        for e in entries:
            skey, key = status_key(e["modelName"], e.get("namespace")), storage_key(e["sourceModelUri"])
            if states.get(skey) != "ModelDownloaded" or (details.get(skey) or {}).get("storageKey") != key:
                out.append(f"{node}: {skey} is {states.get(skey)} ({(details.get(skey) or {}).get('message')})")
            elif not store.is_present(key):
                out.append(f"{node}: {skey} reported Downloaded, but {key} is not on disk")
            elif verify and store.verify(key):
                out.append(f"{node}: {skey} reported Downloaded, but {key} fails verification: {store.verify(key)}")
        on_disk = {k for k in store.keys() if len(k) == 16}  # noqa: SIM118 (NodeStore is not a dict)
        if on_disk - wanted:
            out.append(f"{node}: models no entry wants are still on disk: {sorted(on_disk - wanted)}")
        labels = {k for k in (node_obj["metadata"].get("labels") or {}) if k.startswith(LABEL_PREFIX)}
        want_labels = {model_label(e["sourceModelUri"]) for e in entries}
        if labels != want_labels:
            out.append(f"{node}: labels {sorted(labels)} != {sorted(want_labels)}")
        for label in labels:
            key = label.removeprefix(LABEL_PREFIX)
            if not store.is_present(key) or (verify and store.verify(key)):
                out.append(f"{node}: label {label} but no verified folder")
        meta = agents.root(node) / ".modelcache"
        for folder in ("staging", "repair"):
            left = sorted(p.name for p in (meta / folder).iterdir()) if (meta / folder).is_dir() else []
            if left:
                out.append(f"{node}: left in {folder}: {left}")
    for cache in w.kube.list(LOCAL_MODEL_CACHES).get("items") or []:
        copies = (cache.get("status") or {}).get("copies") or {}
        if copies.get("available") != copies.get("total") or copies.get("failed"):
            out.append(f"cache {cache['metadata']['name']}: copies {copies}")
    return out


def test_chaos(cluster: Cluster, nginx: Any, tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(2**32))
    print(f"\nchaos seed {seed} ({CHAOS_SECONDS:.0f} s; replay: CHAOS_SEED={seed} make chaos)", flush=True)
    rng = random.Random(seed)
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    nginx.set_limit_rate("slow", 400 << 10)
    uris = []
    for i, size in enumerate((256 << 10, 512 << 10, 1 << 20, 1536 << 10, 2 << 20)):
        rel = f"{'slow' if i % 2 else 'fast'}/m{i}.bin"
        nginx.write(rel, size)
        uris.append(nginx.url(rel))
    nginx.write("fast/anchor.bin", 1 << 20)
    w = World(kube, cluster, rng, uris, nginx.url("fast/anchor.bin"))
    for i, node in enumerate(NODE_NAMES):
        w.pools[node] = POOLS[i]
        register(w, node)
    make_group(kube, "gpu", "gpu")
    make_group(kube, "cpu", "cpu")
    kube.create(LOCAL_MODEL_NODE_GROUPS, stable_group())
    coordinators = Coordinators(cluster, tmp_path)
    agents = Agents(cluster, tmp_path)
    sampler = Sampler(kube, agents)
    try:
        coordinators.start()
        coordinators.start()
        for node in NODE_NAMES:
            agents.start(node)
        kube.create(LOCAL_MODEL_CACHES, cache_body(ANCHOR, w.anchor_uri, ["stable"]))
        anchor_key = storage_key(w.anchor_uri)

        def anchored() -> bool:
            return all(NodeStore.at(agents.root(n)).is_present(anchor_key) for n in NODE_NAMES)

        wait_until(anchored, timeout=90, what="the anchor model on both nodes")
        inodes = {n: (agents.root(n) / "models" / anchor_key).stat().st_ino for n in NODE_NAMES}
        sampler.start()

        steps: list[tuple[float, Callable[[World], str]]] = [
            (3, step_cache_create), (2, step_cache_delete), (1.5, step_cache_recreate), (2, step_cache_move),
            (2, step_node_relabel), (1, step_group_selector), (1.5, step_group_replace), (1, step_group_prune),
            (1, step_node_replace),
            (1.5, make_step_agent_kill(agents)), (1, make_step_leader_kill(coordinators)),
        ]
        weights, actions = [s[0] for s in steps], [s[1] for s in steps]
        deadline = time.monotonic() + CHAOS_SECONDS
        while time.monotonic() < deadline:
            w.run_due()
            coordinators.reap()
            action = rng.choices(actions, weights)[0]
            try:
                w.steps.append(f"{w.clock()} {action(w)}")
            except Exception as exc:  # a step racing another change (409, 404): part of the chaos
                w.steps.append(f"{w.clock()} {action.__name__}: {type(exc).__name__}")
            time.sleep(rng.uniform(0.2, 1.5))

        # Settle: every pending restart done, every node back, every process up.
        while w.pending:
            w.run_due()
            time.sleep(0.2)
        for node in NODE_NAMES:
            if not w.node_up.get(node) and kube.get_or_none(NODES, node) is None:
                register(w, node)
            if node not in agents.running:
                agents.start(node)
        while len(coordinators.procs) < 2:
            coordinators.start()
        print("chaos steps:\n  " + "\n  ".join(w.steps), flush=True)
        last: list[str] = []

        def settled() -> bool:
            coordinators.reap()
            last[:] = problems(w, agents, verify=False)
            return not last

        try:
            wait_until(settled, timeout=SETTLE_SECONDS, what="the system to settle")
        except TimeoutError:
            tails = "\n".join(f"--- agent {n}:\n{agents.log_text(n)[-3000:]}" for n in NODE_NAMES)
            pytest.fail(f"seed {seed}: not settled after {SETTLE_SECONDS:.0f} s:\n  " + "\n  ".join(last) +
                        f"\n{tails}", pytrace=False)
        sampler.stop.set()
        sampler.join(10)
        print(f"sampler: {sampler.samples} samples, {len(sampler.violations)} violations", flush=True)
        assert not sampler.violations, f"seed {seed}: " + "\n".join(sampler.violations[:20])
        final = problems(w, agents, verify=True)
        assert not final, f"seed {seed}: " + "\n".join(final)
        for node in NODE_NAMES:
            anchor_dir = agents.root(node) / "models" / anchor_key
            deleted = [line for line in agents.log_text(node).splitlines()
                       if "model deleted" in line and anchor_key in line]
            assert not deleted, f"seed {seed}: {node} deleted the anchor model: {deleted}"
            assert anchor_dir.stat().st_ino == inodes[node], f"seed {seed}: {node}'s anchor folder was replaced"
    finally:
        sampler.stop.set()
        agents.stop()
        coordinators.stop()
