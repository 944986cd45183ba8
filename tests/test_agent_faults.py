"""Agent under storage faults, short disk budgets and kill -9: errors are reported with their
reason and heal without anyone stepping in; nothing half-downloaded is ever visible."""

from __future__ import annotations

import re
import time

import pytest

from modelcache.kube.client import EVENTS, LOCAL_MODEL_NODE_GROUPS
from modelcache.sources.uri import storage_key
from tests.agent_util import (
    create_group,
    create_node,
    entry,
    kube_for,
    model_files,
    node_status,
    start_agent,
    wait_states,
)
from tests.faultproxy import Fault
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(180)

D, E = "ModelDownloaded", "ModelDownloadError"


@pytest.fixture
def kube(cluster):
    for node in ("node-a", "node-b"):
        cluster.register_node(node)
    return kube_for(cluster)


@pytest.mark.parametrize("fault", ["status", "reset"])
def test_storage_fault_is_an_error_then_heals(cluster, kube, nginx, fault_proxy, tmp_path, fault):
    data = nginx.write("f/model.bin", 3 << 20).read_bytes()
    if fault == "status":  # every request answered 503, listing included
        fault_proxy.add(Fault("status", path="/f/model.bin", method=None, times=None, status=503))
    else:  # listing works, every body is reset before its first byte: a reset that lets bytes
        # through is resumed past (an attempt that moves forward is not counted, transfer_control),
        # so only one that never advances is a fault the download cannot outlast
        fault_proxy.add(Fault("reset", path="/f/model.bin", method="GET", times=None, at=0))
    uri = fault_proxy.url("f/model.bin")
    create_node(kube, "node-a", [entry("m", uri)])
    agent = start_agent(cluster.agent_kubeconfig, "node-a", tmp_path / "root", tmp_path)
    try:
        status = wait_states(kube, "node-a", {"m": E}, agent=agent)
        msg = status["modelDetails"]["m"]["message"]
        assert ("503" in msg) if fault == "status" else ("ConnectionResetError" in msg)
        assert "retry" in msg
        assert not (tmp_path / "root" / "models" / storage_key(uri)).exists()
        # The agent keeps retrying on its own (backoff capped at 2 s in the tests).
        wait_until(lambda: node_status(kube, "node-a")["modelDetails"]["m"].get("attempts", 0) >= 3,
                   timeout=30, what="retries")
        _, metrics = agent.get("/metrics")
        assert 'modelcache_agent_errors_total{reason="' in metrics
        fault_proxy.clear()
        status = wait_states(kube, "node-a", {"m": D}, agent=agent, timeout=30)
        assert (tmp_path / "root" / "models" / storage_key(uri) / "model.bin").read_bytes() == data
        assert not status["modelDetails"]["m"].get("message")
        mine: dict = {}

        def events() -> bool:  # recorded just after the status write
            mine.update({e["reason"]: e for e in kube.list(EVENTS, "default")["items"]
                         if e["involvedObject"]["name"] == "node-a"})
            return "Downloaded" in mine

        wait_until(events, timeout=10, what="Downloaded event")
        assert mine["DownloadFailed"]["type"] == "Warning" and mine["DownloadFailed"]["message"].startswith("m: ")
        if fault == "status":  # the same failure again and again: counted on one Event, not duplicated
            assert mine["DownloadFailed"]["count"] >= 2
        assert mine["Downloaded"]["type"] == "Normal"
    finally:
        agent.stop()


def test_insufficient_space_is_a_clear_error_and_other_models_are_untouched(cluster, kube, nginx, tmp_path):
    root = tmp_path / "root"
    create_group(kube, "small", "3Mi", str(root))
    nginx.write("a/model.bin", 1 << 20)
    nginx.write("big/model.bin", 4 << 20)
    nginx.write("c/model.bin", 1 << 20)
    ua, ubig, uc = nginx.url("a/model.bin"), nginx.url("big/model.bin"), nginx.url("c/model.bin")
    create_node(kube, "node-a", [entry("a", ua, nodeGroup="small"), entry("big", ubig, nodeGroup="small"),
                                 entry("c", uc)])
    agent = start_agent(cluster.agent_kubeconfig, "node-a", root, tmp_path)
    try:
        status = wait_states(kube, "node-a", {"a": D, "big": E, "c": D}, agent=agent)
        msg = status["modelDetails"]["big"]["message"]
        # The refusal names the model's size, the limit, what the node holds, and the fix.
        assert "does not fit the node group's storageLimit: the model is 4.0 MiB" in msg, msg
        assert "LocalModelNodeGroup 'small' has storageLimit 3.0 MiB and this node holds " in msg
        assert "modelcache enforces storageLimit (KServe does not)" in msg
        assert "raise spec.storageLimit of LocalModelNodeGroup 'small' (a Kubernetes quantity, e.g. 1Gi)" in msg
        assert status["modelDetails"]["big"]["bytesTotal"] == 4 << 20
        assert not (root / "models" / storage_key(ubig)).exists()
        assert not (root / ".modelcache" / "staging" / storage_key(ubig) / "data" / "model.bin").exists()
        # Refused after the listing's probe, before any of the model's bytes were fetched: each
        # attempt (the agent retries a refusal with backoff; a second one may land before this
        # check on a loaded machine) got the probe's one byte and nothing more.
        gets = nginx.requests_for("big/model.bin")
        assert gets and all(e.bytes_sent <= 1 for e in gets), gets
        assert model_files(root, storage_key(ua)) == {"model.bin": 1 << 20}
        assert model_files(root, storage_key(uc)) == {"model.bin": 1 << 20}
        _, metrics = agent.get("/metrics")
        assert 'modelcache_agent_errors_total{reason="InsufficientSpace"}' in metrics
        assert "modelcache_agent_reserved_bytes 0.0" in metrics  # released after the refusal
        # Raising the limit is all it takes: the next retry fits.
        kube.patch(LOCAL_MODEL_NODE_GROUPS, "small", {"spec": {"storageLimit": "16Mi"}})
        wait_states(kube, "node-a", {"a": D, "big": D, "c": D}, agent=agent, timeout=30)
        assert model_files(root, storage_key(ubig)) == {"model.bin": 4 << 20}
    finally:
        agent.stop()


def test_kill9_mid_download_resumes_and_never_shows_a_half_model(cluster, kube, nginx, fault_proxy, tmp_path):
    size = 4 << 20
    data = nginx.write("slow/model.bin", size).read_bytes()
    fault_proxy.set_rate_limit(600_000)
    uri = fault_proxy.url("slow/model.bin")
    key = storage_key(uri)
    root = tmp_path / "root"
    folder = root / "models" / key
    create_node(kube, "node-a", [entry("m", uri)])

    def no_half_model() -> None:
        if folder.exists():
            files = model_files(root, key)
            assert files in ({}, {"model.bin": size}), files

    agent = start_agent(cluster.agent_kubeconfig, "node-a", root, tmp_path)
    try:
        def some_done() -> bool:
            no_half_model()
            d = node_status(kube, "node-a").get("modelDetails", {}).get("m", {})
            return d.get("state") == "ModelDownloading" and (d.get("bytesDone") or 0) >= (1 << 20)

        wait_until(some_done, timeout=60, what="1 MiB downloaded")
        # Hold nginx's answers still: on a loaded machine the download could otherwise finish
        # before the kill lands (the test then proves nothing about resuming).
        fault_proxy.pause()
    finally:
        agent.kill9()
        fault_proxy.resume()
    done_at_kill = node_status(kube, "node-a")["modelDetails"]["m"]["bytesDone"]
    assert not folder.exists()
    time.sleep(0.5)  # the killed agent's connections, resumed, fail and close
    fault_proxy.reset_counters()
    agent2 = start_agent(cluster.agent_kubeconfig, "node-a", root, tmp_path, name="restarted")
    try:
        deadline = time.monotonic() + 60
        while node_status(kube, "node-a")["modelStatus"].get("m") != D or agent2.proc.poll() is not None:
            assert time.monotonic() < deadline, agent2.log()[-3000:]
            no_half_model()
            time.sleep(0.05)
    finally:
        agent2.stop()
    assert (folder / "model.bin").read_bytes() == data
    refetched = fault_proxy.bytes_sent["/slow/model.bin"]
    # Resumed: what was journalled before the kill is not fetched again (2 chunks in flight may be).
    assert refetched <= size - done_at_kill + 2 * (1 << 20) + (256 << 10), (refetched, done_at_kill)
    assert "download finished" in agent2.log()
    progress = r'msg="progress .*" storage_key=' + key + r" bytes_done=\d+ bytes_total=4194304"
    assert re.search(progress, agent.log()) and re.search(progress, agent2.log())
