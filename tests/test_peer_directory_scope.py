"""The peer directory scoped to our node groups (agent/peering.Directory.scope), on the real control
plane with the agent's own identity (deploy/rbac): an agent learns only of the LocalModelNodes of
its groups (by the ``nodegroup.modelcache.io/<group>`` label the coordinator writes with the
entries), a status change of another group's node reaches none of its watches, and what it keeps
is its groups' objects. bench/peer_directory.py measures the API server's side (events and bytes
per change, before and after)."""

from __future__ import annotations

import time
from typing import Any

from agent.kubemode import entry_groups
from agent.peering import Directory
from modelcache.kube.client import LOCAL_MODEL_NODES, Kube
from modelcache.kube.types import node_group_label
from modelcache.sources.uri import storage_key
from tests.helpers import wait_until

URI = "s3://b/llm"
KEY = storage_key(URI)


def make_lmn(kube: Kube, name: str, group: str | None) -> None:
    entry: dict[str, Any] = {"modelName": "llm", "sourceModelUri": URI, **({"nodeGroup": group} if group else {})}
    kube.create(LOCAL_MODEL_NODES, {"metadata": {"name": name, "labels": {node_group_label(group): "true"} if group
                                                 else {}}, "spec": {"localModels": [entry]}})
    kube.patch_status(LOCAL_MODEL_NODES, name, {"status": {"peer": {
        "endpoint": f"10.0.0.{len(name)}:8443", "certSHA256": "ab" * 32}}})


def names(directory: Directory) -> set[str]:
    return {p.name for p in directory.peers(KEY)}


def test_entry_groups_are_what_the_entries_name_or_none_when_one_names_none() -> None:
    def lmn(*groups: str | None) -> dict[str, Any]:
        return {"spec": {"localModels": [{"modelName": f"m{i}", **({"nodeGroup": g} if g else {})}
                                         for i, g in enumerate(groups)]}}

    assert entry_groups(lmn("a", "b", "a")) == frozenset({"a", "b"})
    assert entry_groups(lmn("a", None)) is None  # an entry of another controller: watch them all
    assert entry_groups(lmn()) == frozenset() and entry_groups(None) == frozenset()


def test_a_directory_learns_only_its_groups_and_another_groups_change_reaches_none_of_its_watches(cluster) -> None:
    admin = cluster.kube()
    for name, group in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("b2", "b"), ("x1", None)):
        make_lmn(admin, name, group)
    directory = Directory(cluster.kube(cluster.agent_kubeconfig), "a1")
    try:
        directory.scope(frozenset({"a"}))
        assert names(directory) == {"a2", "a3"}
        (watch,) = directory.scoped.values()
        assert not directory.informer.started  # no watch of every LocalModelNode
        assert {o["metadata"]["name"] for o in directory.objects()} == {"a1", "a2", "a3"}  # O(group)
        seen: list[str] = []
        watch.add_handler(lambda _e, obj, _old: seen.append(obj["metadata"]["name"]))
        seen.clear()  # add_handler replays what it holds
        # A status change in group b reaches none of our watches; one in group a does.
        admin.patch_status(LOCAL_MODEL_NODES, "b1", {"status": {"modelDetails": {
            "llm": {"storageKey": KEY, "state": "ModelDownloading"}}}})
        admin.patch_status(LOCAL_MODEL_NODES, "a2", {"status": {"modelDetails": {
            "llm": {"storageKey": KEY, "state": "ModelDownloading"}}}})
        wait_until(lambda: "a2" in seen, timeout=30, what="a2's change seen")
        time.sleep(1)
        assert seen == ["a2"]
        # A node that joins group b (its entry and label written): its peers are looked for there too.
        directory.scope(frozenset({"a", "b"}))
        assert names(directory) == {"a2", "a3", "b1", "b2"}
        assert len(directory.scoped) == 2
        # It leaves group a: a's watch is closed and a's nodes are forgotten.
        directory.scope(frozenset({"b"}))
        assert names(directory) == {"b1", "b2"} and list(directory.scoped) == ["b"]
        admin.patch_status(LOCAL_MODEL_NODES, "a3", {"status": {"modelDetails": {
            "llm": {"storageKey": KEY, "state": "ModelDownloaded"}}}})
        time.sleep(2)
        assert seen == ["a2"]  # a's watch closed: a3's change did not reach us
        # An entry that names no group (another controller's): every LocalModelNode, as before.
        directory.scope(None)
        assert names(directory) == {"a2", "a3", "b1", "b2", "x1"} and not directory.scoped
        directory.scope(frozenset())
        assert names(directory) == set()
    finally:
        directory.stop()
