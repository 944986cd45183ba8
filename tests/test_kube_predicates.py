"""Typed metadata and kind views, the one namespaced key, controller-runtime-style predicates, and the
retry on conflicts (no server)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from coordinator.controllers import (
    cache_spec_changed,
    entries_or_states_changed,
    node_changed,
    service_meta_changed,
    volume_exists,
)
from coordinator.view import cache_key
from modelcache.kube.echoes import OwnWrites
from modelcache.kube.informer import object_key
from modelcache.kube.objects import ListMeta, Meta, list_meta, meta, namespaced_key
from modelcache.kube.predicates import all_of, any_of, event_in, on_update, spec_of
from modelcache.kube.status import _retry_on_conflict
from modelcache.kube.types import status_key
from modelcache.kube.views import CacheView, LocalModelNodeView, NodeView


def obj(name: str = "a", namespace: str | None = None, spec: Any = None, status: Any = None,
        **metadata: Any) -> dict[str, Any]:
    md = {"name": name, **({"namespace": namespace} if namespace else {}), **metadata}
    return {"metadata": md, "spec": spec or {}, "status": status or {}}


def test_the_namespaced_key_is_spelled_once() -> None:
    assert namespaced_key("ns", "m") == "ns/m" and namespaced_key(None, "m") == "m" and namespaced_key("", "m") == "m"
    for ns in ("ns", None):
        o = obj("m", ns)
        assert object_key(o) == cache_key(ns, "m") == status_key("m", ns) == meta(o).key == namespaced_key(ns, "m")


def test_meta_reads_what_is_there_and_empties_what_is_not() -> None:
    m = meta(obj("c", "team", labels={"a": "1"}, annotations={"b": "2"}, uid="u1", generation=3,
                 resourceVersion="7", deletionTimestamp="2026-12-02T00:00:00Z", finalizers=["f"]))
    assert (m.name, m.namespace, m.uid, m.generation, m.resource_version, m.labels, m.annotations,
            m.deletion_timestamp, m.finalizers) == ("c", "team", "u1", 3, "7", {"a": "1"}, {"b": "2"},
                                                    "2026-12-02T00:00:00Z", ("f",))
    assert m == meta(obj("c", "team", labels={"a": "1"}, annotations={"b": "2"}, uid="u1", generation=3,
                         resourceVersion="7", deletionTimestamp="2026-12-02T00:00:00Z", finalizers=["f"]))
    assert m != meta(obj("c", "team")) and m != Meta()
    assert m.deleting and m.key == "team/c"
    empty = meta(None)
    assert empty == Meta() and not empty.deleting and empty.labels == {} and meta({"metadata": None}) == Meta()


def test_on_update_passes_adds_and_deletes_and_only_updates_that_change_a_view() -> None:
    changed = on_update(spec_of)
    a, b = obj(spec={"x": 1}), obj(spec={"x": 2})
    assert changed("ADDED", a, None) and changed("DELETED", a, None) and changed("MODIFIED", a, None)
    assert not changed("MODIFIED", obj(spec={"x": 1}, status={"s": 1}), a)  # status only
    assert changed("MODIFIED", b, a)
    assert event_in("ADDED")("ADDED", a, None) and not event_in("ADDED")("MODIFIED", b, a)
    assert any_of(event_in("ADDED"), changed)("MODIFIED", b, a)
    assert not all_of(event_in("ADDED"), changed)("MODIFIED", b, a)


def test_the_coordinators_predicates_are_named_and_filter_as_before() -> None:
    node = obj("n1", labels={"gpu": "a"}, status={"conditions": [{"type": "Ready", "status": "True"}]})
    heartbeat = obj("n1", labels={"gpu": "a"}, status={"conditions": [{"type": "Ready", "status": "True"}],
                                                       "heartbeat": 2})
    relabelled = obj("n1", labels={"gpu": "b"}, status=node["status"])
    not_ready = obj("n1", labels={"gpu": "a"}, status={"conditions": [{"type": "Ready", "status": "False"}]})
    assert not node_changed("MODIFIED", heartbeat, node)
    assert node_changed("MODIFIED", relabelled, node) and node_changed("MODIFIED", not_ready, node)

    lmn = obj("n1", spec={"localModels": [{"modelName": "m"}]}, status={"modelStatus": {"m": "ModelDownloading"}})
    progress = obj("n1", spec=lmn["spec"], status={"modelStatus": {"m": "ModelDownloading"},
                                                   "modelDetails": {"m": {"bytesDone": 5}}})
    done = obj("n1", spec=lmn["spec"], status={"modelStatus": {"m": "ModelDownloaded"}})
    assert not entries_or_states_changed("MODIFIED", progress, lmn)
    assert entries_or_states_changed("MODIFIED", done, lmn)

    svc = obj("s", "team", spec={"predictor": {}})
    assert not service_meta_changed("MODIFIED", obj("s", "team", spec={"predictor": {"x": 1}}), svc)
    assert service_meta_changed("MODIFIED", obj("s", "team", spec=svc["spec"], annotations={"a": "b"}), svc)
    assert service_meta_changed("MODIFIED", obj("s", "team", spec=svc["spec"], deletionTimestamp="t"), svc)

    cache = obj("c", spec={"nodeGroups": ["g"]})
    assert not cache_spec_changed("MODIFIED", obj("c", spec=cache["spec"], status={"copies": 1}), cache)
    assert cache_spec_changed("MODIFIED", obj("c", spec={"nodeGroups": ["h"]}), cache)
    assert cache_spec_changed("MODIFIED", obj("c", spec=cache["spec"], deletionTimestamp="t"), cache)
    assert volume_exists("ADDED", cache, None) and volume_exists("DELETED", cache, None)
    assert not volume_exists("MODIFIED", cache, cache)


def test_meta_reads_the_object_in_place_and_a_list_its_own_metadata() -> None:
    o = obj("c", "team", labels={"a": "1"})
    m = meta(o)
    assert m.labels is o["metadata"]["labels"]  # nothing copied
    o["metadata"]["labels"]["b"] = "2"
    assert m.labels == {"a": "1", "b": "2"}  # read when asked (documented: take it after an edit)
    assert meta({"metadata": {"name": "x", "generation": "4", "creationTimestamp": "t",
                              "ownerReferences": [{"name": "o"}]}}).generation == 4
    assert meta(obj("x", ownerReferences=[{"name": "o"}])).owner_references == [{"name": "o"}]
    assert meta(obj("x", creationTimestamp="t")).creation_timestamp == "t" and meta(None).creation_timestamp == ""
    assert list_meta({"metadata": {"resourceVersion": "9", "continue": "tok"}, "items": []}) == ListMeta("9", "tok")
    assert list_meta({"items": []}) == ListMeta(None, None) == list_meta(None)


def test_the_kind_views_read_what_is_there_and_empty_what_is_not() -> None:
    lmn = LocalModelNodeView(obj("n1", spec={"localModels": [
        {"modelName": "m", "sourceModelUri": "s3://b/m", "nodeGroup": "g"},
        {"modelName": "t", "namespace": "team", "sourceModelUri": "hf://o/t"}, "not a map"]},
        status={"modelStatus": {"m": "ModelDownloaded"}, "nodeUID": "u1",
                "modelDetails": {"m": {"storageKey": "k"}, "t": None}, "peer": {"endpoint": "e"},
                "capacity": {"freeBytes": 5}, "lastUpdated": "now"}))
    assert [(e.model_name, e.namespace, e.source_model_uri, e.node_group, e.key) for e in lmn.entries] == [
        ("m", None, "s3://b/m", "g", "m"), ("t", "team", "hf://o/t", "", "team/t")]
    assert lmn.model_status == {"m": "ModelDownloaded"} and lmn.node_uid == "u1" and lmn.meta.name == "n1"
    assert lmn.detail("m") == {"storageKey": "k"} and lmn.detail("t") == {} and lmn.detail("absent") == {}
    assert lmn.peer == {"endpoint": "e"} and lmn.capacity == {"freeBytes": 5} and lmn.last_updated == "now"
    assert LocalModelNodeView(obj("n2", spec={"storageKeys": ["k"]})).storage_keys == ["k"]
    empty = LocalModelNodeView(None)
    assert (empty.entries, dict(empty.model_status), dict(empty.model_details), empty.node_uid, dict(empty.peer),
            empty.storage_keys, empty.last_updated) == ([], {}, {}, None, {}, [], None)
    assert LocalModelNodeView(obj("n3", status={"modelStatus": ["not", "a", "map"]})).model_status == {}

    cache = CacheView(obj("c", "team", spec={"sourceModelUri": "s3://b/m", "nodeGroups": ["g", "h"],
                                             "modelSize": "1Gi"},
                          status={"nodeStatus": {"n1": "NodeDownloaded"}, "copies": {"available": 1}}))
    assert (cache.key, cache.source_model_uri, cache.node_groups, cache.model_size) == (
        "team/c", "s3://b/m", ["g", "h"], "1Gi")
    assert cache.node_status == {"n1": "NodeDownloaded"} and cache.copies == {"available": 1}
    bare = CacheView(obj("c"))
    assert (bare.key, bare.source_model_uri, bare.node_groups, bare.model_size, dict(bare.node_status)) == (
        "c", "", [], None, {})

    ready = {"type": "Ready", "status": "True"}
    node = NodeView(obj("n1", labels={"gpu": "a"}, status={"conditions": [{"type": "DiskPressure"}, ready,
                                                                          {"type": "Ready", "status": "False"}]}))
    assert node.ready and node.labels == {"gpu": "a"} and len(node.ready_conditions) == 2
    assert not NodeView(obj("n2", status={"conditions": [{"type": "Ready", "status": "Unknown"}]})).ready
    assert not NodeView(obj("n3")).ready and NodeView(None).ready_conditions == []


def test_a_write_is_retried_on_conflicts_only_and_a_deleted_object_is_nothing_to_write() -> None:
    calls: list[int] = []

    def conflicts(times: int, then: Any) -> Any:
        def attempt() -> Any:
            calls.append(1)
            if len(calls) <= times:
                raise ApiException(status=409)
            if isinstance(then, ApiException):
                raise then
            return then
        return attempt

    assert _retry_on_conflict("x", conflicts(2, "written"), retries=5) == "written" and len(calls) == 3
    calls.clear()
    with pytest.raises(ApiException) as err:
        _retry_on_conflict("x", conflicts(10, "never"), retries=3)
    assert err.value.status == 409 and len(calls) == 3
    calls.clear()
    assert _retry_on_conflict("x", conflicts(1, ApiException(status=404)), retries=5) is None and len(calls) == 2
    calls.clear()
    with pytest.raises(ApiException) as err:
        _retry_on_conflict("x", conflicts(0, ApiException(status=500)), retries=5)
    assert err.value.status == 500 and len(calls) == 1


def test_own_writes_hold_back_the_one_event_of_the_version_written_and_nothing_else() -> None:
    own = OwnWrites()
    own.wrote(obj("n1", resourceVersion="7"))
    own.wrote(obj("n2", resourceVersion="3"))
    own.wrote(obj("n3"))  # no version: nothing to recognise it by
    own.wrote(None)
    assert len(own) == 2
    assert own.not_echo("MODIFIED", obj("n1", resourceVersion="6"), None)  # before ours: someone else's
    assert not own.not_echo("MODIFIED", obj("n1", resourceVersion="7"), None)  # ours
    assert own.not_echo("MODIFIED", obj("n1", resourceVersion="7"), None)  # once: a relist's repeat passes
    assert own.not_echo("MODIFIED", obj("n1", resourceVersion="8"), None)
    assert own.not_echo("ADDED", obj("n3"), None)
    # A later write replaces the version kept; a deletion drops it (and is always let through).
    own.wrote(obj("n2", resourceVersion="4"))
    assert own.not_echo("MODIFIED", obj("n2", resourceVersion="3"), None)
    assert own.not_echo("DELETED", obj("n2", resourceVersion="4"), None)
    assert len(own) == 0
    # A reconcile that began after our write (and may have read a copy from before it): the
    # write's event wakes the controller again.
    own.wrote(obj("n1", resourceVersion="9"))
    own.forget("n1")
    assert own.not_echo("MODIFIED", obj("n1", resourceVersion="9"), None)
    own.wrote(obj("x", namespace="ns", resourceVersion="1"))  # keyed namespace/name
    assert own.not_echo("ADDED", obj("x", resourceVersion="1"), None)
    assert not own.not_echo("ADDED", obj("x", namespace="ns", resourceVersion="1"), None)


def test_a_store_reads_many_keys_at_once_in_their_order() -> None:
    from modelcache.kube.informer import Store

    store = Store()
    for name in ("a", "b"):
        store.put(obj(name, resourceVersion="1"))
    got = store.get_raw_many(["b", "x", "a"])
    assert [meta(o).name if o else None for o in got] == ["b", None, "a"]
    assert got[0] is store.get_raw("b")  # the store's own objects, not copies
