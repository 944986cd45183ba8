"""A byzantine peer against real agents on the real control plane (docs/peers.md, "Trust nothing
from a peer"): tests/byzantine.py's TLS peer, listed in the status of a
LocalModelNode ``byz`` as a compromised node's agent would list itself (written with a token bound
to a pod on Node ``byz``: deploy/policies/node-status.yaml lets nothing else), lies to agents
that run as processes with deploy/'s RBAC. The origin: S3 (moto) behind the fault proxy, whose
files have an MD5 the agents check (a source checksum no one can forge), and nginx over plain
HTTP, whose files have none."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from modelcache.kube.client import EVENTS, LOCAL_MODEL_NODES, Kube
from modelcache.sources.uri import storage_key
from tests.agent_util import AgentProc, create_node, kube_for, node_status, set_entries, wait_states
from tests.byzantine import ByzantinePeer, Lies
from tests.faultproxy import FaultProxy
from tests.fixtures.cluster import AGENT_SA, Cluster
from tests.fleet import S3Origin, check_files, entry, model_files, storage_secret, upload_model
from tests.helpers import wait_until
from tests.test_agent_peers import metric, start_group, stop_all

pytestmark = pytest.mark.timeout(300)

D = "ModelDownloaded"
MiB = 1 << 20
#: The agents' stall timeout here: a misbehaving peer must cost at most about two of it.
STALL = 6.0
FLAGS = ("--stall-timeout", str(STALL), "--peer-formation", "1")


@pytest.fixture
def kube(cluster: Cluster) -> Kube:
    return kube_for(cluster)


@pytest.fixture
def s3(cluster: Cluster, kube: Kube, moto_s3: Any) -> Iterator[Callable[[str, int], S3Origin]]:
    """Models on S3 through a fault proxy that counts what the origin sends."""
    proxy = FaultProxy(("127.0.0.1", urlsplit(moto_s3.endpoint).port))
    bucket = moto_s3.new_bucket()
    storage_secret(kube, proxy.base_url, moto_s3.access_key, moto_s3.secret_key)

    def make(prefix: str, seed: int) -> S3Origin:
        files = model_files(5 * MiB, 2, seed=seed)
        upload_model(moto_s3.client(), bucket, prefix, files)
        return S3Origin(bucket, prefix, proxy, files)

    try:
        yield make
    finally:
        proxy.close()


@pytest.fixture
def byzantine(cluster: Cluster, kube: Kube, tmp_path: Path) -> Iterator[Callable[..., ByzantinePeer]]:
    made: list[ByzantinePeer] = []

    def make(lies: Lies, files: dict[str, bytes], uris: list[str]) -> ByzantinePeer:
        """The peer, and LocalModelNode ``byz`` naming it and wanting ``uris``, its status written
        as a compromised agent on Node ``byz`` would write it."""
        peer = ByzantinePeer("byz", files, MiB, tmp_path / "tls-byz", lies)
        made.append(peer)
        cluster.register_node("byz")
        create_node(kube, "byz", [{"modelName": f"m{i}", "sourceModelUri": u} for i, u in enumerate(uris)])
        ns, sa = AGENT_SA
        token = cluster.cp.token(ns, sa, pod=cluster.cp.stand_in_pod(ns, sa, "byz"))
        status = patch_status(cluster, token, "byz", {"status": {"peer": {"endpoint": peer.endpoint,
                                                                          "certSHA256": peer.fingerprint}}})
        assert status == 200
        return peer

    yield make
    for peer in made:
        peer.stop()


def patch_status(cluster: Cluster, token: str, node: str, body: dict[str, Any]) -> int:
    import ssl
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{cluster.server}/apis/serving.kserve.io/v1alpha1/localmodelnodes/{node}/status",
                                 data=json.dumps(body).encode(), method="PATCH",
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/merge-patch+json"})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ssl.create_default_context(cafile=str(cluster.ca_file))):
            return 200
    except urllib.error.HTTPError as exc:
        return exc.code


def victims(cluster: Cluster, kube: Kube, tmp_path: Path, nodes: list[str], *extra: str) -> dict[str, AgentProc]:
    return start_group(cluster, kube, tmp_path, nodes, *FLAGS, *extra)


def excluded(kube: Kube, node: str) -> list[str]:
    return [e["node"] for e in (node_status(kube, node).get("peer") or {}).get("excluded") or []]


def test_a_liar_is_excluded_and_not_asked_again_and_the_group_skips_it_too(cluster, kube, s3, byzantine, tmp_path):
    # F1 (c) on real agents: the liar's bytes fail the file's MD5, the file is read again from the
    # origin, and the pieces are compared: the liar is excluded, durably and visibly (status,
    # Event, metric), node-b never asks it again, and node-c, which starts later, never at all.
    first, second = s3("llm", 1), s3("other", 2)
    byz = byzantine(Lies(forge=True), first.files, [first.uri, second.uri])
    agents = victims(cluster, kube, tmp_path, ["node-b"])
    try:
        set_entries(kube, "node-b", [entry("llm", first.uri)])
        wait_states(kube, "node-b", {"llm": D}, timeout=120, agent=agents["node-b"])
        check_files(tmp_path / "node-b", first.key, first.files)  # 0 wrong bytes
        assert byz.asked["piece"] >= 1
        wait_until(lambda: excluded(kube, "node-b") == ["byz"], timeout=30, what="byz in node-b's status")
        (item,) = node_status(kube, "node-b")["peer"]["excluded"]
        assert re.fullmatch(r"piece \d+ of \S+ has sha-256 [0-9a-f]{64} at the origin, byz said [0-9a-f]{64}",
                            item["reason"]), item
        assert metric(agents["node-b"].get("/metrics")[1], "modelcache_agent_peer_dropped_total") == 1
        assert metric(agents["node-b"].get("/metrics")[1], "modelcache_agent_peers_excluded") == 1
        events = [e for e in kube.list(EVENTS, "default").get("items") or [] if e.get("reason") == "PeerExcluded"]
        assert events and events[0]["involvedObject"]["name"] == "node-b" and "peer byz excluded" in events[0][
            "message"]
        asked = dict(byz.asked)
        # A later pull on node-b, and a pull on node-c that joins afterwards: nobody asks byz.
        set_entries(kube, "node-b", [entry("llm", first.uri), entry("other", second.uri)])
        wait_states(kube, "node-b", {"other": D}, timeout=120, agent=agents["node-b"])
        agents.update(victims(cluster, kube, tmp_path, ["node-c"]))
        set_entries(kube, "node-c", [entry("llm", first.uri)])
        wait_states(kube, "node-c", {"llm": D}, timeout=120, agent=agents["node-c"])
        check_files(tmp_path / "node-c", first.key, first.files)
        assert byz.asked == asked, (byz.asked, asked)
    finally:
        stop_all(agents)


def test_a_liar_gets_no_byte_into_a_model_whose_source_has_no_checksum(cluster, kube, nginx, byzantine, tmp_path):
    # F1 (a)/(b): plain HTTP (no checksum at all): the liar's word alone never makes a piece
    # acceptable (two nodes that read it from the origin must agree), and the first piece node-b
    # reads from the origin shows it lied.
    files = {"model.bin": nginx.write("m/model.bin", 3 * MiB + 5).read_bytes()}
    uri = nginx.url("m/model.bin")
    byz = byzantine(Lies(forge=True), files, [uri])
    agents = victims(cluster, kube, tmp_path, ["node-b"])
    try:
        set_entries(kube, "node-b", [{"modelName": "m", "sourceModelUri": uri}])  # no credentials: plain HTTP
        status = wait_states(kube, "node-b", {"m": D}, timeout=120, agent=agents["node-b"])
        check_files(tmp_path / "node-b", storage_key(uri), files)
        assert byz.asked["piece"] == 0 and status["modelDetails"]["m"]["bytesFromPeers"] == 0
        wait_until(lambda: excluded(kube, "node-b") == ["byz"], timeout=30, what="byz in node-b's status")
    finally:
        stop_all(agents)


@pytest.mark.parametrize("lie", ["trickle", "busy", "claim_all", "tail"])
def test_a_peer_that_stalls_costs_at_most_about_two_stall_timeouts(cluster, kube, s3, byzantine, tmp_path, lie):
    # F2, F3, F8 on real agents: one byte every 2 s, 503 for ever, a claim on every piece, an
    # endless tail: node-b's pull completes from the origin, within about two stall timeouts.
    model = s3("llm", 3)
    lies = {"trickle": Lies(trickle=2.0), "busy": Lies(busy=True), "claim_all": Lies(claim_all=True),
            "tail": Lies(tail=True)}[lie]
    byz = byzantine(lies, model.files, [model.uri])
    agents = victims(cluster, kube, tmp_path, ["node-b"])
    try:
        started = time.monotonic()
        set_entries(kube, "node-b", [entry("llm", model.uri)])
        status = wait_states(kube, "node-b", {"llm": D}, timeout=120, agent=agents["node-b"])
        elapsed = time.monotonic() - started
        check_files(tmp_path / "node-b", model.key, model.files)
        d = status["modelDetails"]["llm"]
        assert d["bytesFromOrigin"] >= model.size and d["bytesFromPeers"] == 0
        assert elapsed < 2 * STALL + 10, elapsed  # + the agent's status interval and the listing
        assert byz.asked["have"] >= 1  # it was heard
    finally:
        stop_all(agents)


def test_a_giant_have_reply_does_not_grow_the_agent(cluster, kube, s3, byzantine, tmp_path):
    # F4 on a real agent: a 512 MiB have reply used to be read whole (RSS +640 MiB).
    model = s3("llm", 4)
    byz = byzantine(Lies(giant_have=512 << 20), model.files, [model.uri])
    agents = victims(cluster, kube, tmp_path, ["node-b"])
    try:
        before = rss(agents["node-b"])
        set_entries(kube, "node-b", [entry("llm", model.uri)])
        wait_states(kube, "node-b", {"llm": D}, timeout=120, agent=agents["node-b"])
        check_files(tmp_path / "node-b", model.key, model.files)
        assert byz.asked["have"] >= 1 and rss(agents["node-b"]) - before < 64 << 20
    finally:
        stop_all(agents)


def rss(agent: AgentProc) -> int:
    with open(f"/proc/{agent.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_removing_a_model_stuck_on_a_trickling_peer_ends_its_download_at_once(cluster, kube, s3, byzantine,
                                                                               tmp_path):
    # F2: cancel used to reach origin streams only: 30 s after it the pull was still blocked.
    model = s3("llm", 5)
    byz = byzantine(Lies(trickle=1.0), model.files, [model.uri])
    agents = victims(cluster, kube, tmp_path, ["node-b"], "--stall-timeout", "600", "--peer-witnesses", "1")
    try:
        set_entries(kube, "node-b", [entry("llm", model.uri)])
        wait_until(lambda: byz.asked["trickled bytes"] >= 2, timeout=60, what="node-b stuck on the peer")
        removed = time.monotonic()
        set_entries(kube, "node-b", [])
        wait_until(lambda: "llm" not in (node_status(kube, "node-b").get("modelStatus") or {}), timeout=30,
                   what="the model gone from node-b's status")
        assert time.monotonic() - removed < 5
        assert 'msg="model left the spec: removing"' in agents["node-b"].log()
        # The read from the peer was cut (its socket shut down), not left to trickle on: the peer's
        # next byte or two find the connection closed.
        wait_until(lambda: byz.asked["cut"] >= 1, timeout=5, what="the peer's connection closed")
    finally:
        stop_all(agents)
    assert kube.get(LOCAL_MODEL_NODES, "node-b")
