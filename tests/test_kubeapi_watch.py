"""Watch semantics of the kubeapi test server through the official client's `watch.Watch`:
order, replay from a resourceVersion, bookmarks, timeoutSeconds, 410 Gone on too-old versions,
selector transitions, and a dropped stream resuming without loss or duplicates."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.kubeapi_helpers import GROUP, VERSION, examples


@pytest.fixture
def apis(kubeapi):
    with kubeapi.api_client() as api_client:
        yield client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)


def _events(func: Any, *args: Any, **kw: Any) -> list[tuple[str, str, str]]:
    """(type, name, resourceVersion) of every event until the server's timeoutSeconds ends the stream."""
    out = []
    for ev in watch.Watch().stream(func, *args, **kw):
        obj = ev["raw_object"]
        out.append((ev["type"], obj["metadata"].get("name", ""), obj["metadata"]["resourceVersion"]))
    return out


def test_watch_from_list_version_sees_changes_in_order(apis):
    core, _ = apis
    core.create_namespaced_config_map("default", {"metadata": {"name": "before"}})
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
    core.patch_namespaced_config_map("a", "default", {"data": {"k": "v"}})
    core.create_namespaced_config_map("kube-system", {"metadata": {"name": "elsewhere"}})
    core.delete_namespaced_config_map("a", "default")
    start = time.monotonic()
    got = _events(core.list_namespaced_config_map, "default", resource_version=rv, timeout_seconds=1)
    assert time.monotonic() - start < 5
    assert [(t, n) for t, n, _ in got] == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
    versions = [int(v) for _, _, v in got]
    assert versions == sorted(versions) and versions[0] > int(rv)
    # cluster-wide watch includes the other namespace
    everywhere = _events(core.list_config_map_for_all_namespaces, resource_version=rv, timeout_seconds=1)
    assert ("ADDED", "elsewhere") in [(t, n) for t, n, _ in everywhere]


def test_watch_without_version_replays_current_state_then_changes(apis):
    _, crd = apis
    crd.create_cluster_custom_object(GROUP, VERSION, "localmodelnodes", examples()["LocalModelNode"])
    seen: list[tuple[str, str]] = []
    ready = threading.Event()

    def writer() -> None:
        ready.wait(5)
        crd.patch_cluster_custom_object_status(GROUP, VERSION, "localmodelnodes", "node-1", {
            "status": {"modelStatus": {"meta-llama3-8b-instruct": "ModelDownloading"}}})

    t = threading.Thread(target=writer)
    t.start()
    for ev in watch.Watch().stream(crd.list_cluster_custom_object, GROUP, VERSION, "localmodelnodes",
                                   timeout_seconds=2):
        seen.append((ev["type"], ev["raw_object"]["metadata"]["name"]))
        ready.set()
        if ev["type"] == "MODIFIED":
            assert ev["raw_object"]["status"]["modelStatus"] == {"meta-llama3-8b-instruct": "ModelDownloading"}
    t.join()
    assert seen == [("ADDED", "node-1"), ("MODIFIED", "node-1")]


def test_resume_from_a_version_in_the_middle(apis):
    core, _ = apis
    versions = [core.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}}).metadata.resource_version
                for i in range(4)]
    got = _events(core.list_namespaced_config_map, "default", resource_version=versions[1], timeout_seconds=1)
    assert [(t, n) for t, n, _ in got] == [("ADDED", "c2"), ("ADDED", "c3")]


def test_bookmarks_carry_the_current_version(apis):
    core, _ = apis
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    latest = core.create_namespaced_secret("default", {"metadata": {"name": "unrelated"}}).metadata.resource_version
    w = watch.Watch()
    bookmarks = [ev for ev in w.stream(core.list_namespaced_config_map, "default", resource_version=rv,
                                       allow_watch_bookmarks=True, timeout_seconds=3) if ev["type"] == "BOOKMARK"]
    assert bookmarks, "expected a BOOKMARK within 3 s (server started with --bookmark-interval 1)"
    assert bookmarks[-1]["raw_object"]["kind"] == "ConfigMap"
    assert int(bookmarks[-1]["raw_object"]["metadata"]["resourceVersion"]) >= int(latest)
    assert w.resource_version == bookmarks[-1]["raw_object"]["metadata"]["resourceVersion"]
    # no bookmarks unless asked for
    assert _events(core.list_namespaced_config_map, "default", resource_version=rv, timeout_seconds=2) == []


def test_too_old_version_is_410_gone(apis, kubeapi):
    core, _ = apis
    old = core.create_namespaced_config_map("default", {"metadata": {"name": "a"}}).metadata.resource_version
    core.create_namespaced_config_map("default", {"metadata": {"name": "b"}})
    kubeapi.compact()
    with pytest.raises(ApiException) as err:
        _events(core.list_namespaced_config_map, "default", resource_version=old, timeout_seconds=1)
    assert err.value.status == 410 and "too old resource version" in str(err.value.reason)
    # a fresh list gives a version that works again
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    assert _events(core.list_namespaced_config_map, "default", resource_version=rv, timeout_seconds=1) == []


def test_bounded_history_expires_old_versions(kubeapi_factory):
    api = kubeapi_factory(history=5)
    with api.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        first = core.create_namespaced_config_map("default", {"metadata": {"name": "x0"}}).metadata.resource_version
        for i in range(1, 8):
            core.create_namespaced_config_map("default", {"metadata": {"name": f"x{i}"}})
        with pytest.raises(ApiException) as err:
            _events(core.list_namespaced_config_map, "default", resource_version=first, timeout_seconds=1)
        assert err.value.status == 410
        recent = core.list_namespaced_config_map("default").metadata.resource_version
        core.create_namespaced_config_map("default", {"metadata": {"name": "y"}})
        got = _events(core.list_namespaced_config_map, "default", resource_version=recent, timeout_seconds=1)
        assert [(t, n) for t, n, _ in got] == [("ADDED", "y")]


def test_label_selector_transitions_become_added_and_deleted(apis):
    core, _ = apis
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    core.create_namespaced_config_map("default", {"metadata": {"name": "m", "labels": {"app": "x"}}})
    core.patch_namespaced_config_map("m", "default", {"metadata": {"labels": {"app": "y"}}})  # leaves selector
    core.patch_namespaced_config_map("m", "default", {"data": {"a": "1"}})  # invisible
    core.patch_namespaced_config_map("m", "default", {"metadata": {"labels": {"app": "x"}}})  # comes back
    core.delete_namespaced_config_map("m", "default")
    got = _events(core.list_namespaced_config_map, "default", resource_version=rv, label_selector="app=x",
                  timeout_seconds=1)
    assert [t for t, _, _ in got] == ["ADDED", "DELETED", "ADDED", "DELETED"]


def test_single_object_watch_by_field_selector(apis):
    core, _ = apis
    rv = core.list_namespaced_pod("default").metadata.resource_version
    for name in ("p1", "p2"):
        core.create_namespaced_pod("default", {"metadata": {"name": name}, "spec": {
            "nodeName": "n1", "containers": [{"name": "c", "image": "i"}]}})
    got = _events(core.list_namespaced_pod, "default", resource_version=rv, field_selector="metadata.name=p2",
                  timeout_seconds=1)
    assert [(t, n) for t, n, _ in got] == [("ADDED", "p2")]
    got = _events(core.list_pod_for_all_namespaces, resource_version=rv, field_selector="spec.nodeName=n1",
                  timeout_seconds=1)
    assert [n for _, n, _ in got] == ["p1", "p2"]


def test_dropped_watch_resumes_without_loss_or_duplicates(apis, kubeapi):
    core, _ = apis
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    seen: list[str] = []
    w = watch.Watch()
    first = threading.Event()

    def consume() -> None:
        # no timeout_seconds: the client reconnects by itself from the last version it saw
        for ev in w.stream(core.list_namespaced_config_map, "default", resource_version=rv,
                           _request_timeout=(5, 30)):
            seen.append(ev["raw_object"]["metadata"]["name"])
            first.set()
            if len(seen) == 6:
                w.stop()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    core.create_namespaced_config_map("default", {"metadata": {"name": "d0"}})
    assert first.wait(10)
    for round_ in range(1, 6):
        kubeapi.drop_watches()
        core.create_namespaced_config_map("default", {"metadata": {"name": f"d{round_}"}})
    t.join(30)
    assert not t.is_alive()
    assert seen == [f"d{i}" for i in range(6)]


def test_timeout_seconds_ends_the_stream(apis):
    core, _ = apis
    start = time.monotonic()
    list(watch.Watch().stream(core.list_node, timeout_seconds=1))
    assert 0.9 <= time.monotonic() - start < 4
