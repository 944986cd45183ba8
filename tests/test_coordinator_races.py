"""The coordinator under change on the real control plane (issue 21): status and labels only
from what an agent reported for the current entry and Node (F3), a vanished node group keeps
its nodes' models (F5), and a leader acts only on a current view while it holds the Lease (F11).
Agents are simulated by status patches written as our agent writes them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from coordinator.nodelabels import model_label
from modelcache.kube.client import (
    LEASES,
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    LOCAL_MODEL_NODES,
    NODES,
    Kube,
    load_api_client,
)
from modelcache.kube.informer import Informer
from tests.coordinator_util import (
    GROUP_LABEL,
    ReconcileProbe,
    agent_report,
    entries_of,
    group_manifest,
    make_cache,
    make_group,
    make_namespace,
    make_node,
)
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until
from tests.test_kube_runtime import Gate

pytestmark = pytest.mark.timeout(180)

URI_A, URI_B = "http://models.example/a.bin", "http://models.example/b.bin"
D = "ModelDownloaded"
WORKER = {GROUP_LABEL: "worker"}


@pytest.fixture
def kube(cluster: Cluster) -> Kube:
    return Kube(load_api_client(str(cluster.kubeconfig)))


def cache_status(kube: Kube, name: str) -> dict[str, Any]:
    return kube.get(LOCAL_MODEL_CACHES, name).get("status") or {}


def labels(kube: Kube, node: str) -> dict[str, str]:
    return kube.get(NODES, node)["metadata"].get("labels") or {}


def uid(kube: Kube, node: str) -> str:
    return str(kube.get(NODES, node)["metadata"]["uid"])


def entry(name: str, uri: str, group: str = "workers") -> dict[str, Any]:
    return {"modelName": name, "sourceModelUri": uri, "nodeGroup": group}


def groups_found(kube: Kube, cache: str) -> str | None:
    conds = [c for c in cache_status(kube, cache).get("conditions") or [] if c["type"] == "NodeGroupsFound"]
    return conds[0]["status"] if conds else None


def test_status_of_the_previous_uri_is_not_believed(cluster: Cluster, kube: Kube, coordinator_factory: Any) -> None:
    """E4: a cache is re-created under the same name with another URI while its agent is not
    writing; the node's status still says ModelDownloaded for the old URI. The node gets no
    label for the new URI and the cache does not count a copy."""
    make_node(kube, "n1", **WORKER)
    make_group(kube, "workers")
    c = coordinator_factory(cluster)
    node_probe = ReconcileProbe(c, "node", lambda key: entries_of(kube, key))
    make_cache(kube, "c1", URI_A, ["workers"])
    wait_until(lambda: entries_of(kube, "n1") == [entry("c1", URI_A)], timeout=30, what="entry for URI A")
    agent_report(kube, "n1", {"c1": (D, URI_A)}, uid(kube, "n1"))
    wait_until(lambda: labels(kube, "n1").get(model_label(URI_A)) == "true", timeout=30, what="label for A")
    # The agent stops writing; c1 goes and comes back with another URI.
    kube.delete(LOCAL_MODEL_CACHES, "c1")
    wait_until(lambda: kube.get_or_none(LOCAL_MODEL_CACHES, "c1") is None, timeout=30, what="c1 finalized")
    make_cache(kube, "c1", URI_B, ["workers"])
    wait_until(lambda: entries_of(kube, "n1") == [entry("c1", URI_B)], timeout=30, what="entry for URI B")
    wait_until(lambda: "n1" in (cache_status(kube, "c1").get("nodeStatus") or {}), timeout=30, what="c1 status")
    assert cache_status(kube, "c1")["nodeStatus"] == {"n1": "NodeDownloadPending"}
    assert cache_status(kube, "c1")["copies"]["available"] == 0
    # A node reconcile that saw the new entry has labelled the node from it: no label for B. (The
    # reconcile that wrote it is not run again for its own write's event: modelcache/kube/echoes.py.)
    kube.patch(NODES, "n1", {"metadata": {"labels": {"touched": "1"}}})
    wait_until(lambda: node_probe.finished("n1", lambda seen: seen == [entry("c1", URI_B)]), timeout=30,
               what="node reconciled with the new entry")
    assert model_label(URI_B) not in labels(kube, "n1") and model_label(URI_A) not in labels(kube, "n1")
    # The agent reports the new URI: now it counts.
    agent_report(kube, "n1", {"c1": (D, URI_B)}, uid(kube, "n1"))
    wait_until(lambda: labels(kube, "n1").get(model_label(URI_B)) == "true", timeout=30, what="label for B")
    wait_until(lambda: cache_status(kube, "c1").get("nodeStatus") == {"n1": "NodeDownloaded"}, timeout=30,
               what="copy counted")


def test_node_replaced_under_the_same_name_does_not_inherit_labels(
        cluster: Cluster, kube: Kube, coordinator_factory: Any) -> None:
    """E6: while the coordinator is down a Node is deleted and registered again (a new machine,
    a new uid) under the same name. The old LocalModelNode's status was written for the old
    Node: the new Node gets no downloaded label until an agent reports for it."""
    make_node(kube, "n1", **WORKER)
    make_group(kube, "workers")
    first = coordinator_factory(cluster)
    make_cache(kube, "c1", URI_A, ["workers"])
    wait_until(lambda: entries_of(kube, "n1") == [entry("c1", URI_A)], timeout=30, what="entry")
    old_uid = uid(kube, "n1")
    agent_report(kube, "n1", {"c1": (D, URI_A)}, old_uid)
    wait_until(lambda: labels(kube, "n1").get(model_label(URI_A)) == "true", timeout=30, what="label")
    # The first coordinator has counted the copy: the status the second one must overwrite.
    wait_until(lambda: cache_status(kube, "c1").get("nodeStatus") == {"n1": "NodeDownloaded"}, timeout=30,
               what="copy counted by the first coordinator")
    first.stop()
    kube.delete(NODES, "n1")
    wait_until(lambda: kube.get_or_none(NODES, "n1") is None, timeout=30, what="Node deleted")
    make_node(kube, "n1", **WORKER)
    new_uid = uid(kube, "n1")
    assert new_uid != old_uid
    second = coordinator_factory(cluster)
    # Waiting for "n1" in nodeStatus was met by the first coordinator's status at once, and the
    # assert after it raced the second one's rewrite (CI of ff6719a). A second coordinator that
    # believed the old Node's status would leave NodeDownloaded: this wait would time out.
    wait_until(lambda: cache_status(kube, "c1").get("nodeStatus") == {"n1": "NodeDownloadPending"} and
               cache_status(kube, "c1").get("copies", {}).get("total") == 1, timeout=30, what="status after restart")
    probe = ReconcileProbe(second, "node")
    kube.patch(NODES, "n1", {"metadata": {"labels": {"touched": "1"}}})  # one more node reconcile, observed
    wait_until(lambda: probe.finished("n1"), timeout=30, what="node reconciled")
    assert model_label(URI_A) not in labels(kube, "n1")
    # The agent on the new machine reports: labels and copies follow.
    agent_report(kube, "n1", {"c1": (D, URI_A)}, new_uid)
    wait_until(lambda: labels(kube, "n1").get(model_label(URI_A)) == "true", timeout=30, what="label for the new Node")
    wait_until(lambda: cache_status(kube, "c1").get("nodeStatus") == {"n1": "NodeDownloaded"}, timeout=30,
               what="copy counted")


class SpecLog:
    """Every spec the API server stored for one LocalModelNode (an informer sees each version)."""

    def __init__(self, kube: Kube, node: str) -> None:
        self.specs: list[list[dict[str, Any]]] = []
        self.informer = Informer(kube, LOCAL_MODEL_NODES, field_selector=f"metadata.name={node}")
        self.informer.add_handler(
            lambda _e, obj, _old: self.specs.append(list((obj.get("spec") or {}).get("localModels") or [])))
        self.informer.start()
        assert self.informer.wait_for_sync(30)

    def stop(self) -> None:
        self.informer.stop()


def test_vanished_node_group_keeps_its_nodes_models(cluster: Cluster, kube: Kube, coordinator_factory: Any) -> None:
    """E11/E13: a node group deleted for a while, then re-created (and replaced with `kubectl
    replace --force`, as GitOps tools do) never takes the entries, so the files, off its nodes."""
    make_node(kube, "n1", **WORKER)
    make_group(kube, "workers")
    c = coordinator_factory(cluster)
    probe = ReconcileProbe(c, "node", lambda _key: "workers" in c.view.group_map())
    make_cache(kube, "c1", URI_A, ["workers"])
    wait_until(lambda: entries_of(kube, "n1") == [entry("c1", URI_A)], timeout=30, what="entry")
    specs = SpecLog(kube, "n1")
    try:
        manifest = group_manifest(kube, "workers")
        kube.delete(LOCAL_MODEL_NODE_GROUPS, "workers")
        wait_until(lambda: probe.finished("n1", lambda group_seen: group_seen is False), timeout=30,
                   what="node reconciled while the group was missing")
        wait_until(lambda: groups_found(kube, "c1") == "False", timeout=30, what="NodeGroupNotFound")
        assert entries_of(kube, "n1") == [entry("c1", URI_A)]
        kube.create(LOCAL_MODEL_NODE_GROUPS, manifest)
        wait_until(lambda: groups_found(kube, "c1") == "True", timeout=30, what="group found again")
        before = kube.get(LOCAL_MODEL_NODE_GROUPS, "workers")["metadata"]["uid"]
        cluster.kubectl("replace", "--force", "-f", "-", input=json.dumps(manifest))
        wait_until(lambda: kube.get(LOCAL_MODEL_NODE_GROUPS, "workers")["metadata"]["uid"] != before, timeout=30,
                   what="group replaced")
        probe.done.clear()
        kube.patch(NODES, "n1", {"metadata": {"labels": {"touched": "1"}}})
        wait_until(lambda: probe.finished("n1"), timeout=30, what="node reconciled after the replace")
        assert entries_of(kube, "n1") == [entry("c1", URI_A)]
        assert all(s == [entry("c1", URI_A)] for s in specs.specs), specs.specs
    finally:
        specs.stop()


def test_vanished_group_entries_go_after_the_grace_period(cluster: Cluster, kube: Kube,
                                                         coordinator_factory: Any) -> None:
    """With --missing-group-grace the entries of a group that stays missing are kept during the
    grace period, dropped once it has passed, and come back with the group."""
    make_node(kube, "n1", **WORKER)
    make_group(kube, "workers")
    c = coordinator_factory(cluster, missing_group_grace=60.0)
    clock = [1000.0]  # the grace period's clock, moved by the test
    c.view.missing._clock = lambda: clock[0]
    probe = ReconcileProbe(c, "node", lambda _key: "workers" in c.view.group_map())
    make_cache(kube, "c1", URI_A, ["workers"])
    wait_until(lambda: entries_of(kube, "n1") == [entry("c1", URI_A)], timeout=30, what="entry")
    manifest = group_manifest(kube, "workers")
    kube.delete(LOCAL_MODEL_NODE_GROUPS, "workers")
    wait_until(lambda: probe.finished("n1", lambda group_seen: group_seen is False), timeout=30,
               what="node reconciled while the group was missing")
    assert entries_of(kube, "n1") == [entry("c1", URI_A)]  # within the grace period
    clock[0] += 61
    kube.patch(NODES, "n1", {"metadata": {"labels": {"touched": "1"}}})
    wait_until(lambda: entries_of(kube, "n1") == [], timeout=30, what="entries dropped after the grace period")
    kube.create(LOCAL_MODEL_NODE_GROUPS, manifest)
    wait_until(lambda: entries_of(kube, "n1") == [entry("c1", URI_A)], timeout=30, what="entry back with the group")


def test_a_node_registered_again_while_its_group_is_missing_keeps_its_entries(cluster: Cluster, kube: Kube,
                                                                            coordinator_factory: Any) -> None:
    """Found by tests/test_chaos.py (its anchor model deleted): a group pruned for a moment (GitOps)
    while a Node is deleted and registered again (`kubectl delete node`, a kubelet restart). A
    deleted Node's LocalModelNode is kept for --deleted-node-grace, untouched, so the node comes
    back with the entries of the missing group (and its agent keeps their files); a Node that stays
    gone loses its LocalModelNode once the grace has passed."""
    for n in ("n1", "n2"):
        make_node(kube, n, **WORKER)
    make_group(kube, "workers")
    c = coordinator_factory(cluster, deleted_node_grace=60.0)
    clock = [1000.0]  # the grace period's clock, moved by the test
    c.view.gone._clock = lambda: clock[0]
    probe = ReconcileProbe(c, "node", lambda key: c.view.nodes.store.get(key) is None)
    make_cache(kube, "c1", URI_A, ["workers"])
    for n in ("n1", "n2"):
        wait_until(lambda n=n: entries_of(kube, n) == [entry("c1", URI_A)], timeout=30, what=f"entry on {n}")
    manifest = group_manifest(kube, "workers")
    kube.delete(LOCAL_MODEL_NODE_GROUPS, "workers")
    for n in ("n1", "n2"):
        kube.delete(NODES, n)
        wait_until(lambda n=n: probe.finished(n, lambda gone: gone is True), timeout=30,
                   what=f"{n} reconciled while its Node was gone")
    make_node(kube, "n1", **WORKER)  # registered again, its group still missing
    wait_until(lambda: probe.finished("n1", lambda gone: gone is False) and c.view.nodes.store.get("n1") is not None,
               timeout=30, what="n1 reconciled again")
    probe.done.clear()
    kube.patch(NODES, "n1", {"metadata": {"labels": {"touched": "1"}}})  # one more reconcile, observed
    wait_until(lambda: probe.finished("n1"), timeout=30, what="n1 reconciled")
    assert entries_of(kube, "n1") == [entry("c1", URI_A)]
    assert entries_of(kube, "n2") == [entry("c1", URI_A)]  # gone, within the grace: untouched
    clock[0] += 61
    kube.patch_status(LOCAL_MODEL_NODES, "n2", {"status": {"modelStatus": {"c1": "ModelDownloadPending"}}})
    wait_until(lambda: kube.get_or_none(LOCAL_MODEL_NODES, "n2") is None, timeout=30,
               what="n2's LocalModelNode deleted after the grace")
    kube.create(LOCAL_MODEL_NODE_GROUPS, manifest)
    probe.done.clear()
    kube.patch(NODES, "n1", {"metadata": {"labels": {"touched": "2"}}})
    wait_until(lambda: probe.finished("n1"), timeout=30, what="n1 reconciled with its group back")
    assert entries_of(kube, "n1") == [entry("c1", URI_A)]


def test_entry_of_a_cache_our_view_has_not_seen_yet_is_kept(cluster: Cluster, kube: Kube,
                                                            coordinator_factory: Any) -> None:
    """F11: the cache informer lags the LocalModelNode informer (another leader, ahead of us, has
    already written a new cache's entry). The entry is not stripped: a cache missing from our
    view is taken as deleted only once the API server says so."""
    make_node(kube, "n1", **WORKER)
    make_group(kube, "workers")
    c = coordinator_factory(cluster)
    probe = ReconcileProbe(c, "node", lambda key: c.view.lmns.store.get(key))
    make_cache(kube, "c1", URI_A, ["workers"])
    wait_until(lambda: entries_of(kube, "n1") == [entry("c1", URI_A)], timeout=30, what="entry")
    hold = Gate("hold")  # holds the cache informer's thread: later cache events are not applied meanwhile
    c.view.caches.add_handler(hold)
    try:
        make_cache(kube, "hold", "http://models.example/hold.bin", ["workers"])
        assert hold.entered.wait(30)
        make_cache(kube, "c2", URI_B, ["workers"])  # our cache informer does not see this one
        wait_until(lambda: len(entries_of(kube, "n1") or []) == 2, timeout=30, what="entry for the held cache")
        current = entries_of(kube, "n1") or []
        kube.patch(LOCAL_MODEL_NODES, "n1", {"spec": {"localModels": [*current, entry("c2", URI_B)]}})

        def saw_c2(lmn: dict[str, Any] | None) -> bool:
            return any(e.get("modelName") == "c2" for e in ((lmn or {}).get("spec") or {}).get("localModels") or [])

        wait_until(lambda: probe.finished("n1", saw_c2), timeout=30, what="node reconciled with the c2 entry")
        assert c.view.caches.store.get("c2") is None  # the view still lags
        assert entry("c2", URI_B) in (entries_of(kube, "n1") or [])
    finally:
        hold.release.set()
    wait_until(lambda: c.view.caches.store.get("c2") is not None, timeout=30, what="view caught up")
    assert entry("c2", URI_B) in (entries_of(kube, "n1") or [])


def holder(kube: Kube) -> str | None:
    lease = kube.get_or_none(LEASES, "modelcache-coordinator", "modelcache-system")
    return None if lease is None else (lease.get("spec") or {}).get("holderIdentity")


def test_paused_leader_does_not_act_after_its_lease_ran_out(cluster: Cluster, kube: Kube,
                                                           coordinator_factory: Any) -> None:
    """F11: a leader that hangs (stops renewing, as a paused process) still believes it leads
    until its renew loop runs again; once a successor holds the Lease it must not reconcile."""
    make_namespace(kube, "modelcache-system")
    make_node(kube, "n1", **WORKER)
    make_group(kube, "workers")
    timing = {"leader_election": True, "lease_duration": 3.0, "renew_deadline": 2.0, "retry_period": 0.3}
    a = coordinator_factory(cluster, wait=False, **timing)
    wait_until(a.controllers_running.is_set, timeout=30, what="first replica leads")
    b = coordinator_factory(cluster, wait=False, **timing)
    make_cache(kube, "c1", URI_A, ["workers"])
    wait_until(lambda: entries_of(kube, "n1") == [entry("c1", URI_A)], timeout=30, what="entry")
    probe = ReconcileProbe(a, "node")
    assert a.elector is not None
    a.elector.pause_renewing()
    wait_until(lambda: holder(kube) == b.cfg.identity and b.controllers_running.is_set(), timeout=30,
               what="successor leads")
    assert a.leading.is_set()  # the hung leader still believes it leads
    probe.done.clear()
    make_cache(kube, "c2", URI_B, ["workers"])
    wait_until(lambda: len(entries_of(kube, "n1") or []) == 2, timeout=30, what="successor wrote the c2 entry")
    wait_until(lambda: probe.count() > 0 or getattr(probe.controller, "deferred", 0) > 0, timeout=30,
               what="the hung leader's node controller picked the change up")
    assert probe.count() == 0, probe.done


def test_a_service_kind_no_longer_served_does_not_stop_reconciles(cluster: Cluster, kube: Kube,
                                                                  coordinator_factory: Any) -> None:
    """The leader waits for a current view of what decides node contents, not of the optional
    service kinds: KServe uninstalled under a running coordinator (its CRD gone, that informer
    failing for good) must not freeze every reconcile."""
    from tests.coordinator_util import without_service_crds

    make_node(kube, "n1", **WORKER)
    make_group(kube, "workers")
    c = coordinator_factory(cluster)
    assert c.view.isvcs is not None
    without_service_crds(cluster)
    wait_until(lambda: not c.view.isvcs.current, timeout=60, what="the InferenceService informer failing")
    make_cache(kube, "c1", URI_A, ["workers"])
    wait_until(lambda: entries_of(kube, "n1") == [entry("c1", URI_A)], timeout=30, what="entry written")
