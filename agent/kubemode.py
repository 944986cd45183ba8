"""Cluster mode: the LocalModelNode named after this node is the spec, its status the report.

One informer watches only that object (``fieldSelector=metadata.name=<node>``), another the
LocalModelNodeGroups for their ``storageLimit``. Status is written through
``patch_status_if_changed``: nothing is sent when nothing differs, and a concurrent writer
makes us re-read instead of overwriting.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

from agent.capacity import GroupLimit
from agent.core import Agent
from agent.downloadjob import DownloadJobs
from agent.hostpath import Mismatch, RootPaths
from agent.logs import fields
from agent.peering import Peering
from agent.publish import Publisher
from modelcache.kube.client import (
    CLUSTER_STORAGE_CONTAINERS,
    CUSTOM_RESOURCE_DEFINITIONS,
    LOCAL_MODEL_NODE_GROUPS,
    LOCAL_MODEL_NODES,
    NODES,
    Kube,
)
from modelcache.kube.events import EventRecorder
from modelcache.kube.informer import DELETED, Informer
from modelcache.kube.objects import meta
from modelcache.kube.quantity import parse_quantity
from modelcache.kube.share import namespace_share
from modelcache.kube.status import patch_status_if_changed
from modelcache.kube.types import NAMESPACE_LIMIT_ANNOTATION, LocalModelNode
from modelcache.kube.validate import node_problems
from modelcache.kube.views import LocalModelNodeView
from modelcache.runtime.clock import rfc3339
from modelcache.runtime.loop import Loop

log = logging.getLogger("agent.kube")

#: Status keys the agent owns (others, written by anyone else, are kept).
OWNED = ("modelStatus", "modelDetails", "capacity", "modelCounts", "observedGeneration", "nodeUID", "conditions",
         "peer")
#: The LocalModelNode CRD, whose status schema decides what the API server keeps of a status write.
NODE_CRD = f"{LOCAL_MODEL_NODES.plural}.{LOCAL_MODEL_NODES.group}"


def status_fields(crd: dict[str, Any] | None) -> set[str] | None:
    """The status fields the LocalModelNode CRD keeps in the version we write, from the CRD object;
    None if unknown (no CRD seen yet, no schema) or if it keeps any field."""
    for version in ((crd or {}).get("spec") or {}).get("versions") or []:
        if version.get("name") != LOCAL_MODEL_NODES.version:
            continue
        schema = ((version.get("schema") or {}).get("openAPIV3Schema") or {}).get("properties") or {}
        status = schema.get("status")
        if not isinstance(status, dict) or status.get("x-kubernetes-preserve-unknown-fields"):
            return None
        return set(status.get("properties") or {})
    return None


def pruned_by_another_schema(ours: dict[str, Any], kept: dict[str, Any], fields: set[str] | None) -> bool:
    """Whether what the server kept of our status write is not what the schema we know keeps: a
    field of ours it has dropped, or one it kept that the schema has not."""
    if fields is None:
        return False
    return any((k in kept) != (k in fields) for k, v in ours.items() if v is not None)


def entry_groups(lmn: dict[str, Any] | None) -> frozenset[str] | None:
    """The node groups a LocalModelNode's entries name; None when an entry names none (written by
    another controller: its peers cannot be told by group)."""
    groups = set()
    for entry in ((lmn or {}).get("spec") or {}).get("localModels") or []:
        group = entry.get("nodeGroup") if isinstance(entry, dict) else None
        if not group:
            return None
        groups.add(str(group))
    return frozenset(groups)


class NodeObjects:
    """The informers of this node's objects and its Event recorder, built before the Agent: the
    agent's ports (download Jobs, Events) read them, and the KubeRunner drives them."""

    def __init__(self, kube: Kube, node: str) -> None:
        self.kube, self.node = kube, node
        self.nodes = Informer(kube, LOCAL_MODEL_NODES, field_selector=f"metadata.name={node}")
        self.groups = Informer(kube, LOCAL_MODEL_NODE_GROUPS)
        #: KServe's ClusterStorageContainers: the download-Job containers (agent/downloadjob.py).
        self.containers = Informer(kube, CLUSTER_STORAGE_CONTAINERS)
        self.recorder = EventRecorder(kube, "modelcache-agent", node)

    def download_jobs(self, namespace: str, host_path: str | None) -> DownloadJobs:
        """KServe's download-Job containers for this node, run in ``namespace``."""
        return DownloadJobs(self.kube, self.node, namespace, host_path,
                            lambda: self.containers.store.list(copy_objects=False),
                            lambda: self.nodes.store.get_raw(self.node))

    def event(self, event_type: str, reason: str, message: str) -> None:
        """An Event on this node's LocalModelNode (none while it does not exist)."""
        obj = self.nodes.store.get(self.node)
        if obj is not None:
            self.recorder.record(obj, event_type, reason, message)


class KubeRunner:
    def __init__(self, agent: Agent, objects: NodeObjects, paths: RootPaths | None = None,
                 peering: Peering | None = None) -> None:
        self.agent, self.kube, self.objects = agent, objects.kube, objects
        self.paths, self.peering = paths, peering
        self._mismatches: list[Mismatch] = []
        self.node = agent.cfg.node
        self.nodes, self.groups, self.containers = objects.nodes, objects.groups, objects.containers
        self.nodes.add_handler(self._on_node)
        self.groups.add_handler(self._on_group)
        self.containers.add_handler(lambda *_: self.agent.containers_changed())
        #: What we last asked for and the status the server kept of it. KServe's CRDs prune every
        #: status field but modelStatus, so what is read back never equals what is wanted: this
        #: pair tells "unchanged since our last write" apart from "changed". Forgotten when the
        #: CRD changes (its schema decides what is kept: our fields come back with ours).
        self._kept: tuple[dict[str, Any], dict[str, Any]] | None = None
        self.schema = Informer(self.kube, CUSTOM_RESOURCE_DEFINITIONS, field_selector=f"metadata.name={NODE_CRD}")
        self.schema.add_handler(self._on_schema)
        self.publisher = Publisher(agent, self._write_status, agent.cfg.status_interval)
        self.synced = threading.Event()
        self._event = objects.event
        self._resync_loop = Loop("agent-resync", self._resync, agent.cfg.resync_period, at_start=False, logger=log)
        #: The uid of the Node object this agent runs for, written as ``status.nodeUID``: the
        #: coordinator believes a status only for the Node that exists now (a machine replaced
        #: under the same name must not inherit the old one's labels).
        self.node_uid: str | None = None

    def refresh_node_uid(self) -> None:
        try:
            node = self.kube.get_or_none(NODES, self.node)
        except Exception as exc:
            log.warning("cannot read this node's Node object; status without nodeUID",
                        extra=fields(node=self.node, error=f"{type(exc).__name__}: {exc}"))
            return
        uid = meta(node).uid or None
        if uid != self.node_uid:
            if self.node_uid is not None:
                log.info("the Node object was replaced", extra=fields(node=self.node, uid=uid or ""))
            self.node_uid = uid
            self.agent.changed.set()

    def _on_node(self, event: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        if meta(obj).name != self.node:
            return
        fresh = old is None or meta(old).uid != meta(obj).uid
        if old is not None and not fresh and event != DELETED and old.get("spec") == obj.get("spec"):
            return  # our own status writes come back as updates: not a spec change (a new object is)
        if event == DELETED:
            # As KServe's agent: a missing LocalModelNode means nothing to do; files stay.
            log.info("LocalModelNode deleted; keeping the models", extra=fields(node=self.node))
            return
        if self.peering is not None:
            # Peers are looked for in our entries' node groups only (before the entries start
            # downloads: a download's first look at the directory finds its group's watch open).
            self.peering.directory.scope(entry_groups(obj))
        if self.synced.is_set():
            if fresh:
                self.refresh_node_uid()  # a new LocalModelNode: its Node may be new as well
            self.check_paths()  # before the new spec can start a removal
        self._apply(obj)

    def _apply(self, obj: dict[str, Any]) -> None:
        """Apply the spec, unless it is invalid: then nothing is applied or deleted, and the status
        (condition SpecValid=False), an Event and the log name each problem."""
        problems = node_problems(obj)
        lmn = LocalModelNode.from_dict(obj)
        if problems:
            first = self.agent.refused is None or self.agent.refused[:2] != (problems, lmn.generation or None)
            self.agent.refuse_spec(problems, lmn.generation or None)
            if first:
                for problem in problems:
                    log.warning("invalid LocalModelNode spec: keeping the last valid one",
                                extra=fields(node=self.node, problem=problem))
                self._event("Warning", "InvalidSpec", f"{len(problems)} problem(s), nothing applied or deleted: "
                            + "; ".join(problems))
            return
        # The persisted modelStatus: before the switch, KServe's agent's (copies it reported
        # ModelDownloaded are carried over while they are verified: agent/state.py).
        reported = LocalModelNodeView(obj).model_status  # empty when it is not a map
        self.agent.set_spec(lmn.spec.local_models, lmn.generation or None,
                            {str(k): str(v) for k, v in reported.items()})

    def _on_group(self, event: str, obj: dict[str, Any], _old: dict[str, Any] | None) -> None:
        name = meta(obj).name
        limit = parse_quantity((obj.get("spec") or {}).get("storageLimit"))
        share = namespace_share(obj)
        if share.invalid:
            log.warning("LocalModelNodeGroup %s: annotation %s=%r is not a quantity (nor 'none'): the default "
                        "per-namespace share applies", name, NAMESPACE_LIMIT_ANNOTATION, share.invalid)
        self.agent.set_group_limit(name, None if event == DELETED or limit is None
                                   else GroupLimit(limit, name, share.limit, share.source))
        if self.synced.is_set():
            self.check_paths()

    def check_paths(self) -> list[Mismatch]:
        """Do the node groups our entries name put their PV where our root is? Says so (log and a
        Warning Event on the LocalModelNode) when the answer changes; removals wait meanwhile."""
        if self.paths is None:
            return []
        obj = self.nodes.store.get_raw(self.node)
        names = {e.node_group for e in LocalModelNodeView(obj).entries if e.node_group}
        found = self.paths.update({n: self.groups.store.get_raw(n) for n in names})
        if found != self._mismatches:
            self.agent.changed.set()  # models of these groups are (no longer) refused as Downloaded
            if found:
                message = self.paths.message(found)
                log.error(message, extra=fields(node=self.node, host_path=self.paths.host_path))
                self._event("Warning", "HostPathMismatch", message)
            else:
                log.info("node group PVs name the model root's host path", extra=fields(
                    node=self.node, host_path=self.paths.host_path))
            self._mismatches = found
        return found

    def _on_schema(self, *_: Any) -> None:
        self._kept = None
        self.agent.changed.set()  # write once under the new schema

    def _desired(self, ours: dict[str, Any]) -> Any:
        def desired(obj: dict[str, Any]) -> dict[str, Any]:
            old = dict(obj.get("status") or {})
            if self._kept == (ours, old):
                return old  # what our last write left, and we want the same: nothing to write
            new = {k: v for k, v in old.items() if k not in (*OWNED, "lastUpdated")}
            new.update(ours)
            if {k: v for k, v in old.items() if k != "lastUpdated"} == new:
                return old  # nothing changed: no write, not even a new timestamp
            new["lastUpdated"] = rfc3339()
            return new

        return desired

    def _write_status(self, ours: dict[str, Any]) -> None:
        current = self.nodes.store.get(self.node)
        if current is None:
            return
        if self.node_uid:
            ours = {**ours, "nodeUID": self.node_uid}
        written = patch_status_if_changed(self.kube, LOCAL_MODEL_NODES, self.node, self._desired(ours),
                                          current=current)
        if written is None:
            return
        kept = dict(written.get("status") or {})
        if pruned_by_another_schema(ours, kept, status_fields(self.schema.store.get(NODE_CRD))):
            # The CRD's watch event can reach us before the API server's own handler switches to
            # the new schema: a write made at once was pruned with the old one (3 of 20 such
            # writes, at load 25). Not remembered, so the next --status-interval writes again.
            log.info("status written under the LocalModelNode CRD's previous schema; writing again",
                     extra=fields(node=self.node))
            self._kept = None
            return
        self._kept = (copy.deepcopy(ours), kept)

    def start(self, timeout: float = 60.0) -> KubeRunner:
        # Containers first: whether a URI none of our sources reads is a download Job's or
        # invalid is decided when the spec's entries arrive.
        self.containers.start()
        self.groups.start()
        self.schema.start()  # not waited for: without it every change is written, as before
        if not self.containers.wait_for_sync(timeout):
            raise TimeoutError(f"could not list ClusterStorageContainers from the API server within {timeout:.0f} s "
                               f"(last error: {self.containers.last_error or 'no answer'})")
        self.nodes.start()
        if not (self.groups.wait_for_sync(timeout) and self.nodes.wait_for_sync(timeout)):
            last = self.nodes.last_error or self.groups.last_error or "no answer"
            raise TimeoutError(f"could not list LocalModelNodes and LocalModelNodeGroups from the API server within "
                               f"{timeout:.0f} s (last error: {last})")
        if self.nodes.store.get(self.node) is None:
            log.info("no LocalModelNode for this node yet; waiting", extra=fields(node=self.node))
        self.refresh_node_uid()
        self.synced.set()
        self.check_paths()
        self.agent.start()
        self.publisher.start()
        self._resync_loop.start()
        return self

    def _resync(self) -> None:
        """Level-triggered safety net: re-apply the cached spec every resync period."""
        self.refresh_node_uid()
        obj = self.nodes.store.get(self.node)
        if obj is not None:
            self._apply(obj)

    def healthy(self) -> bool:
        if not self.synced.is_set():
            return True  # still listing; start() gives up (and the process exits) if that never ends
        return self.agent.alive() and self.publisher.alive()

    def ready(self) -> bool:
        return self.synced.is_set()

    def stop(self) -> None:
        self._resync_loop.stop()
        self.agent.stop()
        self.publisher.stop()
        self.nodes.stop()
        self.groups.stop()
        self.containers.stop()
        self.schema.stop()
