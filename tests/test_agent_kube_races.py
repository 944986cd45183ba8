"""The agent process under change on the real control plane (issue 21): two agents for one
node, a SIGTERM mid-download, a Node replaced under the same name."""

from __future__ import annotations

import signal
import subprocess
from typing import Any

import pytest

from modelcache.kube.client import EVENTS, LOCAL_MODEL_NODES, NODES
from modelcache.kube.informer import Informer
from modelcache.sources.uri import storage_key
from tests.agent_util import create_node, entry, kube_for, node_status, start_agent, wait_states
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(240)

D, DL, P = "ModelDownloaded", "ModelDownloading", "ModelDownloadPending"


@pytest.fixture
def kube(cluster):
    cluster.register_node("node-a")
    return kube_for(cluster)


class StatusLog:
    """Every status the API server stored for one LocalModelNode, in order (an informer)."""

    def __init__(self, kube: Any, node: str) -> None:
        self.seen: list[dict[str, Any]] = []
        self.informer = Informer(kube, LOCAL_MODEL_NODES, field_selector=f"metadata.name={node}")
        self.informer.add_handler(lambda _e, obj, _old: self.seen.append(obj.get("status") or {}))
        self.informer.start()
        self.informer.wait_for_sync(30)

    def bytes_done(self, name: str) -> list[int]:
        return [((s.get("modelDetails") or {}).get(name) or {}).get("bytesDone") or 0 for s in self.seen
                if (s.get("modelStatus") or {}).get(name) == DL]

    def stop(self) -> None:
        self.informer.stop()


def failed_events(kube: Any, node: str) -> list[dict[str, Any]]:
    return [e for e in kube.list(EVENTS, "default")["items"]
            if e["involvedObject"]["name"] == node and e["reason"] == "DownloadFailed"]


def test_second_agent_waits_politely_exits_on_sigterm_and_takes_over(cluster, kube, nginx, tmp_path):
    """F9 and F7: a second agent for the same node and root (a rollout overlap) neither downloads
    nor writes status while the first runs, and exits at once on SIGTERM; the first, stopped,
    reports its download interrupted (not failed, no Warning event); a waiting successor takes
    over and resumes it."""
    # The first agent's download must outlast every step up to the third agent's start (each
    # waits up to 20-30 s). 6 MiB on the test flags' two 1 MiB streams at 200 KiB/s each took 15 s
    # and ran out under load (the file was Downloaded before the SIGTERM); 24 MiB on one stream
    # takes 120 s, and the test raises the rate once those steps are done. (A lower rate instead
    # makes nginx's old worker sleep past the reload's 10 s on its unsent buffer.)
    size = 24 << 20
    nginx.set_limit_rate("slow", 200 << 10)
    nginx.write("slow/model.bin", size)
    uri = nginx.url("slow/model.bin")
    root = tmp_path / "root"
    create_node(kube, "node-a", [entry("m", uri)])
    statuses = StatusLog(kube, "node-a")
    first = start_agent(cluster.agent_kubeconfig, "node-a", root, tmp_path, "--workers", "1", name="first")
    second = third = None
    try:
        wait_until(lambda: (statuses.bytes_done("m") or [0])[-1] > 0, timeout=60, what="first agent downloading")
        second = start_agent(cluster.agent_kubeconfig, "node-a", root, tmp_path, name="second")
        wait_until(lambda: "another agent is running on this root" in second.log(), timeout=30,
                   what="second agent waiting")
        assert second.get("/readyz")[0] != 200 and second.get("/healthz")[0] == 200
        writes_before = len(statuses.seen)
        wait_until(lambda: len(statuses.seen) >= writes_before + 2, timeout=30, what="more progress writes")
        second.proc.send_signal(signal.SIGTERM)
        try:
            second.proc.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail("the waiting agent ignored SIGTERM:\n" + second.log()[-3000:])
        assert node_status(kube, "node-a")["modelStatus"] == {"m": DL}  # the first one still downloads
        assert "download started" not in second.log()
        progress = statuses.bytes_done("m")
        assert progress == sorted(progress), progress  # one writer: progress never jumps back

        third = start_agent(cluster.agent_kubeconfig, "node-a", root, tmp_path, name="third")
        wait_until(lambda: "another agent is running on this root" in third.log(), timeout=30,
                   what="third agent waiting")
        # Two pieces in (4 MiB each): what the third agent must not fetch again.
        wait_until(lambda: (statuses.bytes_done("m") or [0])[-1] >= 8 << 20, timeout=120,
                   what="first agent 8 MiB in")
        first.proc.send_signal(signal.SIGTERM)
        first.proc.wait(20)
        interrupted = [s for s in statuses.seen if (s.get("modelStatus") or {}).get("m") == P
                       and "interrupted" in ((s.get("modelDetails") or {}).get("m") or {}).get("message", "")]
        assert interrupted, statuses.seen[-3:]
        assert not any((s.get("modelStatus") or {}).get("m") == "ModelDownloadError" for s in statuses.seen)
        assert failed_events(kube, "node-a") == []
        nginx.set_limit_rate("slow", 50 << 20)
        wait_states(kube, "node-a", {"m": D}, agent=third, timeout=90)
        assert "taking over" in third.log()
        # Resumed from what the first agent staged, not fetched again from the start: one request
        # for data (the first agent's first) read from byte 0; each agent's listing also probes
        # byte 0 alone (bytes=0-0), and a request without a Range reads it all.
        ranges = [e.range for e in nginx.requests_for("slow/model.bin")]
        from_zero = [r for r in ranges if r is None or (r.startswith("bytes=0-") and r != "bytes=0-0")]
        assert len(from_zero) == 1, ranges
    finally:
        for agent in (first, second, third):
            if agent is not None:
                agent.stop()
        statuses.stop()


def test_status_names_the_node_it_was_written_for(cluster, kube, nginx, tmp_path):
    """F3: the agent writes the uid of the Node it read (status.nodeUID), and the new one after
    the Node is replaced under the same name: the coordinator believes a status only for the Node
    that exists now."""
    nginx.write("f/model.bin", 1 << 20)
    create_node(kube, "node-a", [entry("m", nginx.url("f/model.bin"))])
    agent = start_agent(cluster.agent_kubeconfig, "node-a", tmp_path / "root", tmp_path)
    try:
        first = kube.get(NODES, "node-a")["metadata"]["uid"]
        status = wait_states(kube, "node-a", {"m": D}, agent=agent)
        assert status["nodeUID"] == first
        assert status["modelDetails"]["m"]["storageKey"] == storage_key(nginx.url("f/model.bin"))
        kube.delete(NODES, "node-a")
        wait_until(lambda: kube.get_or_none(NODES, "node-a") is None, timeout=30, what="Node deleted")
        second = cluster.register_node("node-a")["metadata"]["uid"]
        assert second != first
        wait_until(lambda: node_status(kube, "node-a").get("nodeUID") == second, timeout=60,
                   what="status written for the new Node")
        assert node_status(kube, "node-a")["modelStatus"] == {"m": D}
    finally:
        agent.stop()
