"""Typed metadata views, the one namespaced key, and controller-runtime-style predicates (no server)."""

from __future__ import annotations

from typing import Any

from coordinator.controllers import (
    cache_spec_changed,
    entries_or_states_changed,
    node_changed,
    service_meta_changed,
    volume_exists,
)
from coordinator.view import cache_key
from modelcache.kube.informer import object_key
from modelcache.kube.objects import Meta, meta, namespaced_key
from modelcache.kube.predicates import all_of, any_of, event_in, on_update, spec_of
from modelcache.kube.types import status_key


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
    assert m == Meta(name="c", namespace="team", uid="u1", generation=3, resource_version="7", labels={"a": "1"},
                     annotations={"b": "2"}, deletion_timestamp="2026-12-02T00:00:00Z", finalizers=("f",))
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
