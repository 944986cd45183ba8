"""Work queue guarantees: de-duplication, one worker per key, delayed and rate-limited requeue."""

from __future__ import annotations

import threading
import time

import pytest

from modelcache.kube.controller import Controller, Result
from modelcache.kube.workqueue import ExponentialBackoff, ShutDown, WorkQueue


def test_dedup_while_waiting() -> None:
    q = WorkQueue()
    for key in ["a", "b", "a", "a", "c", "b"]:
        q.add(key)
    assert len(q) == 3
    assert [q.get(0), q.get(0), q.get(0)] == ["a", "b", "c"]
    assert q.get(timeout=0.01) is None


def test_key_added_while_processing_is_held_until_done() -> None:
    q = WorkQueue()
    q.add("a")
    assert q.get(0) == "a"
    q.add("a")  # changed while a worker holds it
    q.add("a")
    assert q.get(timeout=0.05) is None  # not handed to a second worker
    q.done("a")
    assert q.get(0) == "a"  # and not lost: once more, exactly once
    q.done("a")
    assert q.get(timeout=0.01) is None


def test_add_after_and_rate_limited_backoff() -> None:
    q = WorkQueue(ExponentialBackoff(base=0.02, cap=0.08))
    start = time.monotonic()
    q.add_after("late", 0.1)
    q.add("now")
    assert q.get(1) == "now"
    assert q.get(1) == "late"
    assert time.monotonic() - start >= 0.1
    delays = [q.add_rate_limited("x") for _ in range(4)]
    assert delays == [0.02, 0.04, 0.08, 0.08]
    assert q.retries("x") == 4
    q.forget("x")
    assert q.retries("x") == 0 and q.backoff.when("x") == 0.02


def test_shutdown_wakes_blocked_getters() -> None:
    q = WorkQueue()
    errors: list[BaseException] = []

    def getter() -> None:
        try:
            q.get()
        except ShutDown as exc:
            errors.append(exc)

    threads = [threading.Thread(target=getter) for _ in range(3)]
    for th in threads:
        th.start()
    time.sleep(0.05)
    q.shutdown()
    for th in threads:
        th.join(2)
    assert len(errors) == 3
    with pytest.raises(ShutDown):
        q.get(0)


def test_workers_never_share_a_key_and_failures_retry() -> None:
    active: dict[str, int] = {}
    overlaps: list[str] = []
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def reconcile(key: str) -> Result:
        with lock:
            active[key] = active.get(key, 0) + 1
            if active[key] > 1:
                overlaps.append(key)
            calls[key] = calls.get(key, 0) + 1
            n = calls[key]
        time.sleep(0.01)
        with lock:
            active[key] -= 1
        if key == "flaky" and n < 3:
            raise RuntimeError("transient")
        return Result()

    ctl = Controller("t", reconcile, workers=4, backoff=ExponentialBackoff(base=0.01, cap=0.05)).start()
    try:
        for _ in range(20):
            for key in ("a", "b", "flaky"):
                ctl.queue.add(key)
            time.sleep(0.002)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (calls.get("flaky", 0) < 3 or len(ctl.queue)):
            time.sleep(0.02)
    finally:
        ctl.stop()
    assert overlaps == []
    assert calls["flaky"] >= 3  # failed twice, retried with backoff, then succeeded
    assert ctl.queue.retries("flaky") == 0  # success forgets the backoff
    assert calls["a"] < 20  # adds during processing were collapsed


def test_mappers_owner_label_and_predicate() -> None:
    from modelcache.kube.controller import generation_or_meta_changed, label_keys, owner_keys

    pvc = {"metadata": {"name": "c-g", "namespace": "team", "ownerReferences": [
        {"kind": "LocalModelCache", "name": "c", "controller": True},
        {"kind": "Other", "name": "x", "controller": False}]}}
    assert owner_keys("LocalModelCache")("ADDED", pvc, None) == ["c"]
    assert owner_keys("Other")("ADDED", pvc, None) == []
    assert owner_keys("Other", controller_only=False)("ADDED", pvc, None) == ["x"]
    assert owner_keys("LocalModelCache", owner_namespaced=True)("ADDED", pvc, None) == ["team/c"]

    old = {"metadata": {"labels": {"internal.serving.kserve.io/localmodel": "a"}}}
    new = {"metadata": {"labels": {"internal.serving.kserve.io/localmodel": "b",
                                   "internal.serving.kserve.io/localmodel-namespace": "ns"}}}
    assert label_keys("internal.serving.kserve.io/localmodel")("MODIFIED", new, old) == ["a", "b"]
    ns_keys = label_keys("internal.serving.kserve.io/localmodel", "internal.serving.kserve.io/localmodel-namespace")
    assert ns_keys("MODIFIED", new, old) == ["ns/b"]
    assert label_keys("x")("ADDED", {"metadata": {}}, None) == []

    base = {"metadata": {"generation": 1, "labels": {"a": "1"}}, "status": {"s": 1}}
    status_only = {"metadata": {"generation": 1, "labels": {"a": "1"}}, "status": {"s": 2}}
    relabelled = {"metadata": {"generation": 1, "labels": {"a": "2"}}}
    assert not generation_or_meta_changed("MODIFIED", status_only, base)
    assert generation_or_meta_changed("MODIFIED", relabelled, base)
    assert generation_or_meta_changed("MODIFIED", {"metadata": {"generation": 2}}, base)
    assert generation_or_meta_changed("ADDED", base, None) and generation_or_meta_changed("DELETED", base, None)
