"""The controller runtime against the real API server (tests/cluster), through the official client."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from modelcache.kube.client import LEASES, LOCAL_MODEL_NODES, NAMESPACES, Kube, load_api_client
from modelcache.kube.controller import Controller, Result
from modelcache.kube.informer import Informer
from modelcache.kube.leader import LeaderElector
from modelcache.kube.status import patch_status_if_changed, update_if_changed
from modelcache.kube.workqueue import ExponentialBackoff
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until

Event = tuple[str, str, str]  # (type, name, resourceVersion)


@pytest.fixture
def kube(cluster: Cluster) -> Kube:
    return Kube(load_api_client(str(cluster.kubeconfig)))


def node(name: str, *uris: str) -> dict[str, Any]:
    models = [{"modelName": f"m{i}", "sourceModelUri": u} for i, u in enumerate(uris)]
    return {"metadata": {"name": name}, "spec": {"localModels": models}}


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.lock = threading.Lock()

    def __call__(self, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        with self.lock:
            self.events.append((kind, obj["metadata"]["name"], obj["metadata"].get("resourceVersion", "")))

    def snapshot(self) -> list[Event]:
        with self.lock:
            return list(self.events)


@pytest.fixture
def informer(kube: Kube) -> Iterator[tuple[Informer, Recorder]]:
    inf = Informer(kube, LOCAL_MODEL_NODES, watch_timeout=30, retry_delay=0.3)
    rec = Recorder()
    inf.add_handler(rec)
    try:
        yield inf, rec
    finally:
        inf.stop()


class Gate:
    """A handler that holds the informer's thread while it handles one named object, so a test
    can end the watch and write while the informer provably has no watch open."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        if obj["metadata"]["name"] == self.name and not self.release.is_set():
            self.entered.set()
            self.release.wait(90)


def wait_for_version(inf: Informer, name: str, rv: str) -> None:
    wait_until(lambda: (inf.store.get_raw(name) or {}).get("metadata", {}).get("resourceVersion") == rv,
               timeout=10, what=f"{name}@{rv} in the informer cache")


def test_events_arrive_in_order(kube: Kube, informer: tuple[Informer, Recorder]) -> None:
    inf, rec = informer
    before = kube.create(LOCAL_MODEL_NODES, node("pre", "s3://b/pre"))
    inf.start()
    assert inf.wait_for_sync(10)
    created = kube.create(LOCAL_MODEL_NODES, node("n1", "s3://b/a"))
    spec = kube.patch(LOCAL_MODEL_NODES, "n1", {"spec": {"localModels": [{"modelName": "x", "sourceModelUri": "gs://x"}]}})
    status = kube.patch_status(LOCAL_MODEL_NODES, "n1", {"status": {"modelStatus": {"x": "ModelDownloading"}}})
    kube.delete(LOCAL_MODEL_NODES, "n1")
    wait_until(lambda: len(rec.snapshot()) >= 5, timeout=10, what="5 events")
    time.sleep(0.2)
    events = rec.snapshot()
    assert events[0] == ("ADDED", "pre", before["metadata"]["resourceVersion"])
    assert events[1:4] == [
        ("ADDED", "n1", created["metadata"]["resourceVersion"]),
        ("MODIFIED", "n1", spec["metadata"]["resourceVersion"]),
        ("MODIFIED", "n1", status["metadata"]["resourceVersion"]),
    ]
    assert events[4][:2] == ("DELETED", "n1") and len(events) == 5
    assert [int(e[2]) for e in events] == sorted(int(e[2]) for e in events)
    assert inf.store.keys() == ["pre"]
    assert inf.store.get("pre")["spec"] == before["spec"]


def test_ended_or_dropped_watch_misses_and_duplicates_nothing(kube: Kube) -> None:
    # The API server ends each watch after its timeoutSeconds (2 s here), or the client's socket dies.
    inf = Informer(kube, LOCAL_MODEL_NODES, watch_timeout=2, retry_delay=0.3)
    rec = Recorder()
    inf.add_handler(rec)
    try:
        _resume_rounds(kube, inf, rec)
    finally:
        inf.stop()


def _resume_rounds(kube: Kube, inf: Informer, rec: Recorder) -> None:
    inf.start()
    assert inf.wait_for_sync(10)
    written: list[dict[str, Any]] = [kube.create(LOCAL_MODEL_NODES, node(f"a{i}", f"s3://b/{i}")) for i in range(3)]
    wait_for_version(inf, "a2", written[-1]["metadata"]["resourceVersion"])
    for round_ in range(3):
        gate = Gate(f"t{round_}")
        inf.add_handler(gate)
        written.append(kube.create(LOCAL_MODEL_NODES, node(f"t{round_}", "s3://b/t")))
        assert gate.entered.wait(10)
        # Server side (the watch's timeoutSeconds passes while the handler holds the informer), or
        # client side (the socket dies).
        if round_ % 2 == 0:
            time.sleep(2.5)
        else:
            inf.drop_connection()
        # Written while no watch is open: must come from the resumed watch, exactly once.
        written.append(kube.create(LOCAL_MODEL_NODES, node(f"b{round_}", "hf://o/m")))
        state = ("ModelDownloading", "ModelDownloaded", "ModelDownloadError")[round_]
        written.append(kube.patch_status(LOCAL_MODEL_NODES, "a0", {"status": {"modelStatus": {"m0": state}}}))
        gate.release.set()
        wait_for_version(inf, "a0", written[-1]["metadata"]["resourceVersion"])
    events = rec.snapshot()
    seen = [(name, rv) for _kind, name, rv in events]
    assert len(seen) == len(set(seen)), f"an event was delivered twice: {events}"
    assert sorted(seen) == sorted((o["metadata"]["name"], o["metadata"]["resourceVersion"]) for o in written)
    # A watch the server ended on time resumed from the last resourceVersion (no relist); the one
    # whose socket died (round 1) relisted, since a restore cannot be told from it by versions.
    assert inf.stats["lists"] == 2 and inf.stats["relists"] == 1
    assert inf.stats["watches"] >= 4


def test_410_gone_triggers_a_relist_that_reports_only_real_changes(cluster: Cluster, kube: Kube) -> None:
    inf = Informer(kube, LOCAL_MODEL_NODES, watch_timeout=2, retry_delay=0.3)
    rec = Recorder()
    inf.add_handler(rec)
    gate = Gate("trigger")
    inf.add_handler(gate)
    try:
        _gone_relists(cluster, kube, inf, rec, gate)
    finally:
        inf.stop()


def _gone_relists(cluster: Cluster, kube: Kube, inf: Informer, rec: Recorder, gate: Gate) -> None:
    for name in ("keep", "change", "remove"):
        kube.create(LOCAL_MODEL_NODES, node(name, f"s3://b/{name}"))
    inf.start()
    assert inf.wait_for_sync(10)
    wait_until(lambda: len(inf.store) == 3, timeout=10, what="3 objects cached")
    # Hold the informer inside a handler while the server ends its watch on time (2 s), change
    # things, compact etcd and restart the API server (its watch cache starts again from now): the
    # watch the informer resumes from its last resourceVersion must get 410, and only a relist
    # catches up. (A watch lost mid-stream relists without asking: the test below.)
    kube.create(LOCAL_MODEL_NODES, node("trigger", "s3://b/t"))
    assert gate.entered.wait(10)
    time.sleep(2.5)  # the watch has ended: what is written from here on never reaches it
    changed = kube.patch(LOCAL_MODEL_NODES, "change", {"metadata": {"labels": {"x": "y"}}})
    kube.delete(LOCAL_MODEL_NODES, "remove")
    added = kube.create(LOCAL_MODEL_NODES, node("new", "oci://r/m:1"))
    cluster.cp.restart_apiserver(between=cluster.cp.compact_etcd)
    mark = len(rec.snapshot())
    gate.release.set()
    wait_until(lambda: inf.stats["gone"] >= 1 and inf.stats["lists"] >= 2, timeout=60, what="410 and relist")
    wait_for_version(inf, "new", added["metadata"]["resourceVersion"])
    wait_until(lambda: inf.store.get_raw("remove") is None, timeout=5, what="deleted object dropped")
    after = rec.snapshot()[mark:]
    deleted = [e for e in after if e[0] == "DELETED"]
    assert sorted(after) == sorted([
        ("MODIFIED", "change", changed["metadata"]["resourceVersion"]),
        ("ADDED", "new", added["metadata"]["resourceVersion"]),
        *deleted,
    ])  # "keep" and "trigger" did not change, so the relist reported nothing for them
    assert [e[1] for e in deleted] == ["remove"]
    assert sorted(inf.store.keys()) == ["change", "keep", "new", "trigger"]
    # And the informer is live again after the relist.
    later = kube.patch(LOCAL_MODEL_NODES, "keep", {"metadata": {"labels": {"z": "1"}}})
    wait_for_version(inf, "keep", later["metadata"]["resourceVersion"])


def backed_up(cluster_factory: Any, first: str) -> tuple[Any, Kube, Any]:
    """A cluster of the test's own (it will be restored) holding one LocalModelNode, ``first``,
    and a backup of its etcd taken then: the cluster, a client and the backup."""
    cluster = cluster_factory()
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    kube.create(LOCAL_MODEL_NODES, node(first, f"s3://b/{first}"))
    return cluster, kube, cluster.cp.backup_etcd()


def written_after_the_backup(kube: Kube, inf: Informer, writes: int) -> None:
    """"lost", created after the backup and patched ``writes`` times (more writes than the
    restored control plane makes on its own, so the informer's version stays ahead of the
    restored store's), once the informer has followed every write."""
    lost = kube.create(LOCAL_MODEL_NODES, node("lost", "s3://b/lost"))
    for i in range(writes):
        lost = kube.patch(LOCAL_MODEL_NODES, "lost", {"metadata": {"labels": {"n": str(i)}}})
    rv = lost["metadata"]["resourceVersion"]
    wait_until(lambda: (inf.store.get_raw("lost") or {}).get("metadata", {}).get("resourceVersion") == rv,
               timeout=30, what="the informer has followed every write")


@pytest.mark.timeout(240)
def test_watch_from_a_version_in_the_servers_future_relists(cluster_factory: Any) -> None:
    """After an etcd restore the informer's resourceVersion lies in the server's future: the API
    server answers the resumed watch with "Too large resource version" (an ERROR event, 504),
    which no retry of the same watch can cure. The informer relists and follows the restored
    store (issue 21, F10)."""
    cluster, kube, backup = backed_up(cluster_factory, "before")
    inf = Informer(kube, LOCAL_MODEL_NODES, watch_timeout=30, retry_delay=0.3)
    rec = Recorder()
    inf.add_handler(rec)
    inf.start()
    try:
        assert inf.wait_for_sync(60)
        written_after_the_backup(kube, inf, 300)  # far more than the restored control plane writes
        cluster.cp.restore_etcd(backup)
        after = kube.create(LOCAL_MODEL_NODES, node("after", "s3://b/after"))
        wait_until(lambda: inf.store.get_raw("after") is not None, timeout=90,
                   what="an object written after the restore")
        wait_for_version(inf, "after", after["metadata"]["resourceVersion"])
        wait_until(lambda: inf.store.get_raw("lost") is None, timeout=10, what="object lost in the restore dropped")
        assert sorted(inf.store.keys()) == ["after", "before"]
        assert inf.stats["relists"] >= 1 and inf.current
        assert ("DELETED", "lost") in [(e[0], e[1]) for e in rec.snapshot()]
    finally:
        inf.stop()


def test_a_watch_lost_to_a_restore_relists_though_the_cluster_wrote_past_its_version(cluster_factory: Any) -> None:
    """CI's etcd-restore failure (stop 40, twice): the API server restarts on the restored store,
    the informer's watch breaks mid-stream, and by the time it reconnects the cluster has written
    past the informer's version, so "is the server behind us?" says no. A watch resumed from that
    version skipped what the restored store got in between (here "after"), and kept what the
    restore removed ("lost"): the coordinator wrote a removed cache back onto its node. A watch
    lost mid-stream now relists; the long retry delay makes the race certain (without the fix this
    test fails: "after" never arrives)."""
    cluster, kube, backup = backed_up(cluster_factory, "before")
    inf = Informer(kube, LOCAL_MODEL_NODES, watch_timeout=300, retry_delay=30)
    rec = Recorder()
    inf.add_handler(rec)
    inf.start()
    try:
        assert inf.wait_for_sync(60)
        written_after_the_backup(kube, inf, 50)  # so "after" is inside the gap
        ours = int(inf.last_resource_version or 0)
        cluster.cp.restore_etcd(backup)  # the watch breaks; the informer waits 30 s to reconnect
        after = kube.create(LOCAL_MODEL_NODES, node("after", "s3://b/after"))
        assert int(after["metadata"]["resourceVersion"]) <= ours  # inside the gap a resumed watch skips
        for i in range(ours - int(after["metadata"]["resourceVersion"]) + 20):  # the cluster writes past us
            kube.patch(LOCAL_MODEL_NODES, "before", {"metadata": {"labels": {"n": str(i)}}})
        # Before the informer's retry: without the fix it resumed from ``ours`` now and never saw "after".
        assert cluster.cp.etcd_revision() > ours and inf.store.get_raw("after") is None
        wait_until(lambda: inf.store.get_raw("after") is not None and inf.store.get_raw("lost") is None,
                   timeout=60, what="the restored store followed: 'after' seen, 'lost' dropped")
        assert sorted(inf.store.keys()) == ["after", "before"] and inf.current
        assert inf.stats["relists"] == 1 and inf.stats["went_back"] == 0  # the version check alone said no
        assert ("DELETED", "lost") in [(e[0], e[1]) for e in rec.snapshot()]
    finally:
        inf.stop()


def test_a_server_behind_the_informer_is_relisted_before_the_next_watch_not_after_a_silent_one(
        cluster_factory: Any) -> None:
    """The race review's finding 1, at the informer: the "server went back in time" check ran only
    after a watch that received nothing for a whole timeout, so once ordinary writes flowed again
    the gap was never re-read. Now the server's current version is compared with the informer's
    before every watch it opens: a server behind it (what a restore leaves, however the watch
    behaves) is relisted at once. Here the watch ended on time before the restore, so no broken
    stream tells the informer (the test above): only the check does."""
    cluster, kube, backup = backed_up(cluster_factory, "seen")
    inf = Informer(kube, LOCAL_MODEL_NODES, watch_timeout=2, retry_delay=0.3)
    gate = Gate("held")
    inf.add_handler(gate)
    inf.start()
    try:
        assert inf.wait_for_sync(60)
        written_after_the_backup(kube, inf, 50)  # the restored store will be behind us
        kube.create(LOCAL_MODEL_NODES, node("held", "s3://b/held"))
        assert gate.entered.wait(10)
        time.sleep(2.5)  # the server ends the watch on time while the informer is held in a handler
        lists = inf.stats["lists"]
        cluster.cp.restore_etcd(backup)
        gate.release.set()  # the informer reads the watch's clean end; the next one would open behind
        wait_until(lambda: inf.stats["went_back"] == 1 and inf.stats["lists"] == lists + 1, timeout=30,
                   what="a relist before the next watch (not after a silent one)")
        assert inf.current and sorted(inf.store.keys()) == ["seen"]
        assert inf.stats["relists"] == 1  # the check alone: no broken stream, no unreachable server
        created = kube.create(LOCAL_MODEL_NODES, node("after", "s3://b/after"))
        wait_for_version(inf, "after", created["metadata"]["resourceVersion"])
        assert inf.stats["went_back"] == 1  # followed from the server's own version since
    finally:
        inf.stop()


def test_two_workers_never_reconcile_one_key_at_once(kube: Kube) -> None:
    inf = Informer(kube, LOCAL_MODEL_NODES, watch_timeout=30)
    active: dict[str, int] = {}
    overlaps: list[str] = []
    last_seen: dict[str, str] = {}
    lock = threading.Lock()

    def reconcile(key: str) -> Result:
        with lock:
            active[key] = active.get(key, 0) + 1
            if active[key] > 1:
                overlaps.append(key)
        obj = inf.store.get(key)
        time.sleep(0.03)  # long enough for more events on the same key to arrive meanwhile
        with lock:
            active[key] -= 1
            if obj is not None:
                last_seen[key] = obj["metadata"]["resourceVersion"]
        return Result()

    ctl = Controller("test", reconcile, workers=4).watch(inf)
    inf.start()
    ctl.start(wait_sync=10)
    try:
        final: dict[str, str] = {}
        for name in ("k0", "k1"):
            final[name] = kube.create(LOCAL_MODEL_NODES, node(name, "s3://b/x"))["metadata"]["resourceVersion"]
        for i in range(15):
            for name in ("k0", "k1"):
                obj = kube.patch_status(LOCAL_MODEL_NODES, name, {"status": {"modelStatus": {f"m{i}": ""}}})
                final[name] = obj["metadata"]["resourceVersion"]
        wait_until(lambda: all(last_seen.get(k) == rv for k, rv in final.items()), timeout=15,
                   what="the latest version of each key reconciled")
    finally:
        ctl.stop()
        inf.stop()
    assert overlaps == []


def test_conflict_is_retried_and_unchanged_status_is_not_written(kube: Kube) -> None:
    stale = kube.create(LOCAL_MODEL_NODES, node("c1", "s3://b/x"))
    # Someone else writes after we read: our compare-and-swap must get 409 and recompute.
    kube.patch_status(LOCAL_MODEL_NODES, "c1", {"status": {"modelStatus": {"other": "ModelDownloaded"}}})
    calls: list[dict[str, Any]] = []

    def desired(obj: dict[str, Any]) -> dict[str, Any]:
        calls.append(obj)
        status = obj.get("status") or {}
        return {**status, "modelStatus": {**(status.get("modelStatus") or {}), "m0": "ModelDownloading"}}

    written = patch_status_if_changed(kube, LOCAL_MODEL_NODES, "c1", desired, current=stale)
    assert written is not None
    assert len(calls) == 2  # first from the stale copy (409), then from the fresh object
    assert written["status"]["modelStatus"] == {"other": "ModelDownloaded", "m0": "ModelDownloading"}
    rv = written["metadata"]["resourceVersion"]
    assert patch_status_if_changed(kube, LOCAL_MODEL_NODES, "c1", desired) is None  # no change, no write
    assert kube.get(LOCAL_MODEL_NODES, "c1")["metadata"]["resourceVersion"] == rv

    # Removed keys are removed (merge-patch nulls), not left behind.
    gone = patch_status_if_changed(kube, LOCAL_MODEL_NODES, "c1", lambda o: {"modelStatus": {"m0": "ModelDownloaded"}})
    assert gone is not None and gone["status"] == {"modelStatus": {"m0": "ModelDownloaded"}}

    # Spec edits via PUT: stale copy -> 409 -> re-read -> applied once.
    stale = kube.get(LOCAL_MODEL_NODES, "c1")
    kube.patch(LOCAL_MODEL_NODES, "c1", {"metadata": {"labels": {"a": "b"}}})

    def add_finalizer(obj: dict[str, Any]) -> None:
        fins = obj["metadata"].setdefault("finalizers", [])
        if "x/y" not in fins:
            fins.append("x/y")

    updated = update_if_changed(kube, LOCAL_MODEL_NODES, "c1", add_finalizer, current=stale)
    assert updated is not None and updated["metadata"]["finalizers"] == ["x/y"]
    assert updated["metadata"]["labels"] == {"a": "b"}  # the concurrent write survived
    assert update_if_changed(kube, LOCAL_MODEL_NODES, "c1", add_finalizer) is None

    # A conflict that never ends is reported, not retried forever.
    flips = iter(["ModelDownloading", "ModelDownloaded"] * 5)

    def always_conflict(obj: dict[str, Any]) -> dict[str, Any]:
        kube.patch_status(LOCAL_MODEL_NODES, "c1", {"status": {"modelStatus": {"t": next(flips)}}})
        return {"modelStatus": {"m0": "ModelDownloadError"}}

    with pytest.raises(ApiException) as err:
        patch_status_if_changed(kube, LOCAL_MODEL_NODES, "c1", always_conflict, retries=3)
    assert err.value.status == 409

    # Deleted after we read it (a cached copy): nothing to write, no error.
    cached = kube.get(LOCAL_MODEL_NODES, "c1")
    kube.patch(LOCAL_MODEL_NODES, "c1", {"metadata": {"finalizers": None}})
    kube.delete(LOCAL_MODEL_NODES, "c1")
    assert patch_status_if_changed(kube, LOCAL_MODEL_NODES, "c1", lambda o: {"modelStatus": {}}, current=cached) is None
    relabel = lambda o: o["metadata"].setdefault("labels", {}).update(gone="yes")  # noqa: E731
    assert update_if_changed(kube, LOCAL_MODEL_NODES, "c1", relabel, current=cached) is None


def test_leader_election_hands_over_when_the_leader_stops_renewing(kube: Kube) -> None:
    kube.create(NAMESPACES, {"metadata": {"name": "le"}})
    timing = {"lease_duration": 1.5, "renew_deadline": 1.0, "retry_period": 0.2}
    started: list[str] = []
    a = LeaderElector(kube, "le", "ctl", "a", on_started_leading=lambda: started.append("a"), **timing).start()
    assert a.wait_for_leadership(5)
    b = LeaderElector(kube, "le", "ctl", "b", on_started_leading=lambda: started.append("b"), **timing).start()
    try:
        time.sleep(1.0)
        assert not b.is_leader  # a keeps renewing, so b waits
        lease = kube.get(LEASES, "ctl", "le")
        assert lease["spec"]["holderIdentity"] == "a" and lease["spec"]["leaseTransitions"] == 0

        t0 = time.monotonic()
        a.pause_renewing()  # a hangs: no renewals, no release
        assert b.wait_for_leadership(6)
        assert time.monotonic() - t0 >= 1.0  # not before the lease could have expired
        lease = kube.get(LEASES, "ctl", "le")
        assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
        wait_until(lambda: len(started) == 2, timeout=5, what="on_started_leading callbacks")
        assert started == ["a", "b"]

        # A clean shutdown releases the lease, so the next candidate takes over without waiting.
        c = LeaderElector(kube, "le", "ctl", "c", **{**timing, "lease_duration": 30.0, "renew_deadline": 20.0})
        c.start()
        time.sleep(0.5)
        assert not c.is_leader
        b.stop()
        assert not b.is_leader
        assert c.wait_for_leadership(3)
        c.stop()
        assert kube.get(LEASES, "ctl", "le")["spec"].get("holderIdentity") in (None, "")
    finally:
        a.stop(1)
        b.stop(1)


def test_leader_election_on_a_conflict_only_one_wins(kube: Kube) -> None:
    kube.create(NAMESPACES, {"metadata": {"name": "le2"}})
    electors = [LeaderElector(kube, "le2", "race", f"c{i}", lease_duration=5, renew_deadline=3, retry_period=1)
                for i in range(4)]
    barrier = threading.Barrier(len(electors))
    results: dict[str, bool] = {}

    def attempt(e: LeaderElector) -> None:
        barrier.wait()
        results[e.identity] = e.try_acquire_or_renew()

    threads = [threading.Thread(target=attempt, args=(e,)) for e in electors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    winners = [ident for ident, won in results.items() if won]
    assert len(winners) == 1
    assert kube.get(LEASES, "race", "le2")["spec"]["holderIdentity"] == winners[0]


def test_failing_reconcile_backs_off_and_recovers(kube: Kube) -> None:
    inf = Informer(kube, LOCAL_MODEL_NODES)
    attempts: list[float] = []

    def reconcile(key: str) -> Result:
        attempts.append(time.monotonic())
        if len(attempts) < 4:
            raise RuntimeError("not yet")
        kube.patch_status(LOCAL_MODEL_NODES, key, {"status": {"modelStatus": {"m0": "ModelDownloaded"}}})
        return Result()

    ctl = Controller("retry", reconcile, workers=1, backoff=ExponentialBackoff(base=0.1, cap=1.0)).watch(
        inf, predicate=lambda ev, obj, old: ev == "ADDED")
    inf.start()
    ctl.start(10)
    try:
        kube.create(LOCAL_MODEL_NODES, node("r1", "s3://b/x"))
        wait_until(lambda: (kube.get(LOCAL_MODEL_NODES, "r1").get("status") or {}).get("modelStatus"), timeout=10,
                   what="reconciled after retries")
    finally:
        ctl.stop()
        inf.stop()
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert len(attempts) == 4
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19 and gaps[2] >= 0.39  # 0.1, 0.2, 0.4: exponential
    assert ctl.queue.retries("r1") == 0


def test_a_patch_asked_for_metadata_only_is_answered_with_the_metadata_it_wrote(kube: Kube) -> None:
    """The coordinator's label patches of Nodes (coordinator/nodes.py): the API server answers
    with a PartialObjectMetadata, whose version is the one the watch event will carry."""
    kube.create(NAMESPACES, {"metadata": {"name": "metaonly"}})
    out = kube.patch(NAMESPACES, "metaonly", {"metadata": {"labels": {"a": "1"}}}, metadata_only=True)
    assert out["kind"] == "PartialObjectMetadata" and out["apiVersion"] == "meta.k8s.io/v1"
    assert set(out) == {"kind", "apiVersion", "metadata"}  # no spec, no status
    stored = kube.get(NAMESPACES, "metaonly")
    assert out["metadata"]["labels"]["a"] == "1" == stored["metadata"]["labels"]["a"]
    assert out["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
    assert out["metadata"]["uid"] == stored["metadata"]["uid"]
    whole = kube.patch(NAMESPACES, "metaonly", {"metadata": {"labels": {"a": None}}})
    assert whole["kind"] == "Namespace" and "spec" in whole  # the default: the whole object
