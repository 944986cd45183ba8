"""Peer transfer between agents (docs/peers.md) on the real control plane: agents as processes with
deploy/'s RBAC and a peer token for the modelcache-peer audience, the model on S3 (moto) behind
the fault proxy, which counts (and may throttle) what the origin sends."""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelcache.kube.client import LOCAL_MODEL_NODES
from tests.agent_util import AgentProc, create_node, kube_for, node_status, set_entries, start_agent, wait_states
from tests.faultproxy import Fault, FaultProxy
from tests.fleet import (
    S3Origin,
    check_files,
    entry,
    model_files,
    peer_args,
    peer_endpoint,
    peer_token,
    storage_secret,
    upload_model,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(300)

D = "ModelDownloaded"


@pytest.fixture
def kube(cluster):
    return kube_for(cluster)


@pytest.fixture
def origin(cluster, kube, moto_s3) -> Iterator[S3Origin]:
    """4 files (~6 MiB) on S3, read through a proxy throttled to 3 MiB/s (origin-bound, as a busy
    Hub or a cross-region bucket is)."""
    port = urlsplit(moto_s3.endpoint).port
    proxy = FaultProxy(("127.0.0.1", port))
    bucket = moto_s3.new_bucket()
    files = model_files(6 << 20, 3)
    upload_model(moto_s3.client(), bucket, "llm", files)
    storage_secret(kube, proxy.base_url, moto_s3.access_key, moto_s3.secret_key)
    proxy.set_rate_limit(3 << 20)
    try:
        yield S3Origin(bucket, "llm", proxy, files)
    finally:
        proxy.close()


def start_group(cluster, kube, tmp_path: Path, nodes: list[str], *extra: str,
                args: dict[str, list[str]] | None = None) -> dict[str, AgentProc]:
    """Agents for ``nodes``, each with its LocalModelNode (no model yet) and its peer endpoint
    published, so that a model given to all of them at once is a group that starts together."""
    token = peer_token(cluster.cp, tmp_path / "tokens")
    agents: dict[str, AgentProc] = {}
    for node in nodes:
        cluster.register_node(node)
        create_node(kube, node, [])
        (tmp_path / "tmp" / node).mkdir(parents=True, exist_ok=True)  # its TMPDIR: see temp_leftovers
        agents[node] = start_agent(cluster.agent_kubeconfig, node, tmp_path / node, tmp_path,
                                   *peer_args(token), *extra, *(args or {}).get(node, []),
                                   env={"TMPDIR": str(tmp_path / "tmp" / node)})
    for node, agent in agents.items():
        try:
            wait_until(lambda n=node: peer_endpoint(kube, n), timeout=60, what=f"{node}'s peer endpoint")
        except TimeoutError:
            raise AssertionError(f"{node} published no peer endpoint:\n{agent.log()[-3000:]}") from None
    return agents


def temp_leftovers(tmp_path: Path, nodes: list[str]) -> list[str]:
    """What the agents left in their TMPDIRs (their self-signed peer pairs must not stay there)."""
    return sorted(str(p.relative_to(tmp_path)) for n in nodes for p in (tmp_path / "tmp" / n).iterdir())


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a /metrics page (0 if absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def stop_all(agents: dict[str, AgentProc]) -> None:
    for agent in agents.values():
        agent.stop()


def test_a_group_that_starts_together_reads_the_origin_about_once(cluster, kube, origin, tmp_path):
    nodes = ["node-a", "node-b", "node-c"]
    agents = start_group(cluster, kube, tmp_path, nodes)
    try:
        # Each made its self-signed pair (the endpoints are published) and kept no file of it.
        assert temp_leftovers(tmp_path, nodes) == []
        for node in nodes:
            set_entries(kube, node, [entry("llm", origin.uri)])
        status = {n: wait_states(kube, n, {"llm": D}, timeout=120, agent=agents[n]) for n in nodes}
        for node in nodes:
            check_files(tmp_path / node, origin.key, origin.files)

        sent = origin.origin_bytes()
        # Each piece is read from the origin by one node (a few may be read twice while the
        # swarm forms); without peers this would be 3x the model.
        assert origin.size <= sent <= 1.2 * origin.size, (sent, origin.size)
        details = {n: status[n]["modelDetails"]["llm"] for n in nodes}
        assert len({d["listingDigest"] for d in details.values()}) == 1
        for n, d in details.items():
            assert d["bytesFromOrigin"] + d["bytesFromPeers"] >= origin.size, (n, d)
            assert d["bytesFromPeers"] > 0, (n, d)  # everyone got pieces from the others
        assert abs(sum(d["bytesFromOrigin"] for d in details.values()) - sent) <= 64 << 10
        for n in nodes:
            peer = node_status(kube, n)["peer"]
            assert peer["bytesFromOrigin"] == details[n]["bytesFromOrigin"]
            assert peer["bytesFromPeers"] == details[n]["bytesFromPeers"]
            assert re.fullmatch(r"[0-9a-f]{64}", peer["certSHA256"]) and peer["endpoint"].startswith("127.0.0.1:")

        # Visible: kubectl -o wide, the log line, the metrics.
        wide = cluster.kubectl("get", "localmodelnodes", "-o", "wide").stdout
        head, *rows = wide.strip().splitlines()
        assert "FROMORIGIN" in head and "FROMPEERS" in head
        for n in nodes:
            (row,) = [r for r in rows if r.split()[0] == n]
            assert str(details[n]["bytesFromPeers"]) in row.split()
        for n, agent in agents.items():
            assert re.search(rf"download finished\".*bytes_from_origin={details[n]['bytesFromOrigin']} "
                             rf"bytes_from_peers={details[n]['bytesFromPeers']}", agent.log()), agent.log()[-2000:]
            _, metrics = agent.get("/metrics")
            by_source = {s: metric(metrics, "modelcache_agent_model_bytes_total", storage_key=origin.key, source=s)
                         for s in ("origin", "peer")}
            assert by_source == {"origin": details[n]["bytesFromOrigin"], "peer": details[n]["bytesFromPeers"]}
        uploaded = sum(metric(a.get("/metrics")[1], "modelcache_agent_peer_uploaded_bytes_total")
                       for a in agents.values())
        assert uploaded == sum(d["bytesFromPeers"] for d in details.values())
    finally:
        stop_all(agents)
    assert all(kube.get(LOCAL_MODEL_NODES, n) for n in nodes)


def seed(cluster, kube, tmp_path: Path, origin: S3Origin, node: str, *extra: str) -> AgentProc:
    """A node that holds the whole model already (downloaded alone from the origin)."""
    (agent,) = start_group(cluster, kube, tmp_path, [node], *extra).values()
    set_entries(kube, node, [entry("llm", origin.uri)])
    wait_states(kube, node, {"llm": D}, timeout=120, agent=agent)
    check_files(tmp_path / node, origin.key, origin.files)
    origin.proxy.reset_counters()
    return agent


def test_a_peer_serving_corrupted_bytes_is_dropped_and_the_model_completes_verified(cluster, kube, origin,
                                                                                   tmp_path):
    # node-a serves through the fault proxy, which holds node-a's certificate (so node-b's pinning
    # accepts it) and flips a byte in the first pieces it relays.
    from coordinator.certs import generate_self_signed
    from modelcache.peers.server import server_context
    from tests.helpers import free_port

    cert, key = generate_self_signed(tmp_path / "a-tls", ["node-a"])
    upstream = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    upstream.check_hostname, upstream.verify_mode = False, ssl.CERT_NONE
    port = free_port()
    proxy = FaultProxy(("127.0.0.1", port), tls_server=server_context(str(cert), str(key)), tls_upstream=upstream)
    flip = proxy.add(Fault("flip", path_pattern=r"/files/\d+$", times=3))
    agents = {"node-a": seed(cluster, kube, tmp_path, origin, "node-a", "--peer-port", str(port),
                             "--peer-address", f"127.0.0.1:{proxy.port}", "--peer-tls-cert", str(cert),
                             "--peer-tls-key", str(key))}
    try:
        agents.update(start_group(cluster, kube, tmp_path, ["node-b"]))
        set_entries(kube, "node-b", [entry("llm", origin.uri)])
        status = wait_states(kube, "node-b", {"llm": D}, timeout=120, agent=agents["node-b"])
        check_files(tmp_path / "node-b", origin.key, origin.files)  # never a wrong file
        assert flip.applied >= 1 and proxy.requests  # node-b did ask node-a, and got a flipped piece
        log = agents["node-b"].log()
        assert re.search(r"peer dropped for model \w+: piece \d+ of \S+ has sha-256 [0-9a-f]{64}, node-a advertised",
                         log), log[-3000:]
        assert metric(agents["node-b"].get("/metrics")[1], "modelcache_agent_peer_dropped_total") == 1
        # Dropped for the model: after the bad piece nothing more was asked of node-a (the requests
        # node-b's two workers had in flight then, at most, all of them flipped; without the drop it
        # would have asked for all nine pieces); what it had not delivered came from the origin, and
        # node-b's bytes add up to the model once.
        d = status["modelDetails"]["llm"]
        assert flip.seen == flip.applied <= 2 and d["bytesFromOrigin"] > 0
        assert d["bytesFromOrigin"] + d["bytesFromPeers"] == origin.size
        assert origin.origin_bytes() == d["bytesFromOrigin"]
    finally:
        stop_all(agents)
        proxy.close()


def test_kill_9_of_a_serving_peer_mid_transfer_and_every_other_node_completes_verified(cluster, kube, origin,
                                                                                        tmp_path):
    # node-a holds the model and serves it slowly (1 MiB/s in all); node-b and node-c start together
    # and read from it until it is killed; what it had not delivered they fill from the origin and
    # from each other.
    agents = {"node-a": seed(cluster, kube, tmp_path, origin, "node-a", "--peer-upload-rate", "1Mi")}
    try:
        assert re.search(r'msg="peer transfer on" .*upload_rate=1048576', agents["node-a"].log())  # the server's
        agents.update(start_group(cluster, kube, tmp_path, ["node-b", "node-c"]))
        for node in ("node-b", "node-c"):
            set_entries(kube, node, [entry("llm", origin.uri)])

        def from_peers() -> int:
            return sum(((node_status(kube, n).get("modelDetails") or {}).get("llm") or {}).get("bytesFromPeers", 0)
                       for n in ("node-b", "node-c"))

        wait_until(lambda: from_peers() >= 2 << 20, timeout=60, what="2 MiB read from node-a")
        agents["node-a"].kill9()
        status = {n: wait_states(kube, n, {"llm": D}, timeout=120, agent=agents[n]) for n in ("node-b", "node-c")}
        for node in ("node-b", "node-c"):
            check_files(tmp_path / node, origin.key, origin.files)
            d = status[node]["modelDetails"]["llm"]
            assert d["bytesFromPeers"] > 0
            # The kill cost at most the pieces in flight (2 workers x 1 MiB), never a refetch of the model.
            assert d["bytesFromOrigin"] + d["bytesFromPeers"] <= origin.size + (2 << 20), d
        # What node-a had not delivered was read from the origin about once, not once per node.
        assert origin.origin_bytes() <= origin.size, (origin.origin_bytes(), origin.size)
    finally:
        stop_all(agents)


def test_only_the_clusters_agents_may_read_and_only_the_pinned_certificate_is_trusted(cluster, kube, origin,
                                                                                      tmp_path):
    import urllib3

    from modelcache.peers.client import PeerClient, PeerError, PeerInfo, PeerRefused
    from modelcache.peers.pieces import piece_count
    from modelcache.peers.protocol import Geometry

    agent = seed(cluster, kube, tmp_path, origin, "node-a")
    try:
        peer = node_status(kube, "node-a")["peer"]
        digest = node_status(kube, "node-a")["modelDetails"]["llm"]["listingDigest"]
        host, port = peer["endpoint"].rsplit(":", 1)
        pool = urllib3.HTTPSConnectionPool(host, int(port), cert_reqs="CERT_NONE", assert_hostname=False,
                                           assert_fingerprint=peer["certSHA256"], retries=False)
        path = f"/v1/models/{origin.key}/{digest}/files/0"
        first = sorted(origin.files)[0]

        def get(token: str | None) -> urllib3.BaseHTTPResponse:
            headers = {"Range": "bytes=0-7"} | ({"Authorization": f"Bearer {token}"} if token is not None else {})
            return pool.urlopen("GET", path, headers=headers)

        anonymous = get(None)
        assert anonymous.status == 401 and anonymous.headers["WWW-Authenticate"].startswith("Bearer")
        assert get("not-a-token").status == 401
        # The agent's own identity, but a token for the API server (the audience is wrong).
        assert get(cluster.cp.token("modelcache-system", "modelcache-agent")).status == 401
        # A token for the peer audience, of another ServiceAccount (the coordinator's): not an agent.
        other = peer_token(cluster.cp, tmp_path / "tokens", service_account="modelcache-coordinator")
        assert get(other.read_text()).status == 403
        ok = get(peer_token(cluster.cp, tmp_path / "tokens").read_text())
        assert ok.status == 206 and ok.data == origin.files[first][:8]
        _, metrics = agent.get("/metrics")
        assert metric(metrics, "modelcache_agent_peer_rejected_total", reason="unauthenticated") == 3
        assert metric(metrics, "modelcache_agent_peer_rejected_total", reason="forbidden") == 1

        # Another certificate at that address (a node impersonating node-a) is refused before the
        # request, and so before the token, is sent.
        client = PeerClient(lambda: peer_token(cluster.cp, tmp_path / "tokens").read_text())
        impostor = PeerInfo("node-a", host, int(port), "0" * 64)
        geometry = Geometry(1 << 20, tuple(piece_count(len(origin.files[p]), 1 << 20) for p in sorted(origin.files)))
        with pytest.raises(PeerError) as caught:
            client.have(impostor, origin.key, digest, geometry, "-", 0, 0)
        assert not isinstance(caught.value, PeerRefused) and "fingerprint" in str(caught.value).lower()
        genuine = PeerInfo("node-a", host, int(port), peer["certSHA256"])
        reply = client.have(genuine, origin.key, digest, geometry, "-", 0, 0)
        assert reply.complete and len(reply.pieces) == sum(geometry.counts)  # --chunk-size 1Mi: pieces of 1 MiB
    finally:
        agent.stop()


def test_off_switch_and_auto_without_a_token_read_every_byte_from_the_origin(cluster, kube, origin, tmp_path):
    agents = {}
    try:
        for node, args in (("node-a", ["--peers", "off"]),
                           ("node-b", ["--peers", "auto", "--peer-token-file", str(tmp_path / "no-token")])):
            cluster.register_node(node)
            create_node(kube, node, [])
            agents[node] = start_agent(cluster.agent_kubeconfig, node, tmp_path / node, tmp_path, *args)
        for node in agents:
            set_entries(kube, node, [entry("llm", origin.uri)])
        for node, agent in agents.items():
            status = wait_states(kube, node, {"llm": D}, timeout=120, agent=agent)
            check_files(tmp_path / node, origin.key, origin.files)
            assert "peer" not in status and "bytesFromPeers" not in status["modelDetails"]["llm"]
        assert origin.origin_bytes() == 2 * origin.size
        assert "peer transfer off (--peers=off)" in agents["node-a"].log()
        assert 'msg="peer transfer off: no peer token"' in agents["node-b"].log()
    finally:
        stop_all(agents)
