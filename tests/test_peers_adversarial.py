"""A lying or broken peer cannot poison, wedge, starve or bloat a pull (docs/peers.md, "Trust nothing
from a peer"), without a cluster: real pulls with peer transfer in one process, and a byzantine
peer (tests/byzantine.py) in the directory, over real TLS. Each finding of the peer review
(F1-F14, as docs/peers.md states the rules) that concerns the downloading side is a test here; the same
peer against real agents on the control plane: tests/test_agent_peers_adversarial.py."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from modelcache.engine.transfer import TransferOptions
from modelcache.peers.client import Cancel, PeerCancelled, PeerClient, PeerError, PeerInfo
from modelcache.peers.network import PeerNetwork
from modelcache.peers.pieces import PieceRecord, hash_piece, piece_count
from modelcache.peers.protocol import Geometry
from modelcache.pull import pull
from modelcache.sources.credentials import Settings
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.byzantine import ByzantinePeer, Lies
from tests.fixtures.gcs import GCSServer
from tests.helpers import REPO
from tests.peer_util import TOKEN, MiB, Node, check, make_source, node_factory, pull_all

pytestmark = pytest.mark.timeout(120)

#: A short stall timeout: every bound below scales with it (a piece waits for peers at most half).
STALL = 4.0
#: The model (a local folder) has no source checksum: by default a piece is taken from a peer only
#: when two nodes that read it from the origin agree. The liveness tests take one node's word
#: (``witnesses=1``), so that the byzantine peer is a holder whose bytes would be taken; the
#: trust tests keep the default.


@pytest.fixture
def directory() -> dict[str, PeerInfo]:
    return {}


@pytest.fixture
def make_node(tmp_path: Path, directory: dict[str, PeerInfo]) -> Iterator[Callable[..., Node]]:
    yield from node_factory(tmp_path, directory)


@pytest.fixture
def model(tmp_path: Path) -> tuple[str, dict[str, bytes]]:
    files = make_source(tmp_path / "src", {"a.bin": 4 * MiB, "b.bin": 2 * MiB + 77, "config.json": 300})
    return f"file://{tmp_path / 'src'}", files


@pytest.fixture
def byzantine(tmp_path: Path, model: tuple[str, dict[str, bytes]],
              directory: dict[str, PeerInfo]) -> Iterator[Callable[..., ByzantinePeer]]:
    made: list[ByzantinePeer] = []

    def make(lies: Lies, name: str = "byz", complete: bool = True, files: dict[str, bytes] | None = None
             ) -> ByzantinePeer:
        peer = ByzantinePeer(name, files or model[1], MiB, tmp_path / f"tls-{name}", lies)
        directory[name] = peer.info(complete=complete)
        made.append(peer)
        return peer

    yield make
    for peer in made:
        peer.stop()


def timed_pull(node: Node, uri: str, cancel: threading.Event | None = None, settings: Settings | None = None,
               **options: Any) -> tuple[float, Any]:
    started = time.monotonic()
    opts = TransferOptions(chunk_size=MiB, workers=options.pop("workers", 2),
                           stall_timeout=options.pop("stall_timeout", STALL), **options)
    result = pull(uri, root=node.root, peers=node.network, options=opts, cancel=cancel, settings=settings)
    return time.monotonic() - started, result


def stats(node: Node, uri: str) -> Any:
    return node.network.stats(storage_key(uri))


@pytest.mark.parametrize("lie", ["tail", "trickle"])
def test_a_peer_that_never_finishes_a_piece_gives_way_to_the_origin(make_node, byzantine, model, lie):
    # F2: the right piece then an endless tail (the client used to drain it), or one byte every
    # two seconds (each read returned in time, the piece never): the pull used to hang for ever.
    uri, files = model
    byz = byzantine(Lies(tail=True) if lie == "tail" else Lies(trickle=2.0))
    node = make_node("victim", witnesses=1)
    elapsed, _ = timed_pull(node, uri)
    check(node, uri, files)
    s = stats(node, uri)
    assert s.from_origin == sum(map(len, files.values())) and s.from_peers == 0
    # Within two stall timeouts, and the peer was asked once per worker, then left alone.
    assert elapsed < 2 * STALL, elapsed
    assert byz.asked["piece"] <= 2, byz.asked
    assert byz.asked["tail KiB"] <= 2  # its tail was not read: the connection was closed


def test_cancel_returns_within_a_second_while_a_peer_holds_a_read(make_node, byzantine, model):
    # F2: cancel used to abort origin streams only; a read blocked on a peer stayed blocked.
    uri, _ = model
    byz = byzantine(Lies(trickle=1.0))
    node = make_node("victim", piece_min_time=600.0, witnesses=1)  # the read's own deadline is far away
    cancel = threading.Event()
    outcome: list[Any] = []
    ended = threading.Event()

    def run() -> None:
        try:
            timed_pull(node, uri, cancel=cancel, stall_timeout=600.0)
        except BaseException as exc:
            outcome.append(exc)
        ended.set()

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 30
    while byz.asked["trickled bytes"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert byz.asked["trickled bytes"] >= 2, "the pull never got stuck on the peer"
    cancelled_at = time.monotonic()
    cancel.set()
    assert ended.wait(5)
    assert time.monotonic() - cancelled_at < 1.0
    assert outcome and "cancel" in str(outcome[0]).lower(), outcome


def test_a_peer_whose_name_never_resolves_holds_no_read_past_its_deadline_nor_a_cancel(make_node, model,
                                                                                     monkeypatch):
    # A node may publish a name as its endpoint (--peer-address HOST); getaddrinfo cannot be
    # interrupted, and a name whose DNS server does not answer held the read 5 s per try.
    import socket as socket_mod

    from modelcache.peers import client as client_mod

    real = socket_mod.getaddrinfo
    hung = threading.Event()

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.peer.test":
            hung.wait(30)  # a DNS server that never answers
        return real(host, *args, **kwargs)

    monkeypatch.setattr(client_mod.socket, "getaddrinfo", getaddrinfo)
    uri, _ = model
    seed = make_node("seed")
    timed_pull(seed, uri)
    key = storage_key(uri)
    digest = seed.network.stats(key).listing_digest
    slow = PeerInfo("slow", "slow.peer.test", seed.server.port, seed.info.fingerprint)
    client = PeerClient(lambda: TOKEN)
    buf = memoryview(bytearray(MiB))
    try:
        started = time.monotonic()
        with pytest.raises(PeerError, match=r"cannot resolve slow\.peer\.test"):
            client.read(slow, key, digest, 0, 0, MiB, buf, time.monotonic() + 1.0)
        assert time.monotonic() - started < 1.5
        cancel = Cancel()
        threading.Timer(0.3, cancel.cancel).start()
        started = time.monotonic()
        with pytest.raises(PeerCancelled):
            client.read(slow, key, digest, 0, 0, MiB, buf, time.monotonic() + 60, cancel)
        assert time.monotonic() - started < 0.3 + 0.5
        # An address is used as it is, and a name that resolves at once as before.
        named = PeerInfo("seed", "localhost", seed.server.port, seed.info.fingerprint)
        assert client.read(named, key, digest, 0, 0, MiB, buf, time.monotonic() + 10) == MiB
    finally:
        hung.set()
        client.close()


def test_a_peer_that_is_busy_for_ever_does_not_starve_the_pull(make_node, byzantine, model):
    # F3: 503 for every piece while advertising all of them: no origin byte in 75 s, failure after
    # ~3 minutes, 18 requests/s at the busy peer.
    uri, files = model
    byz = byzantine(Lies(busy=True))
    node = make_node("victim", witnesses=1)
    elapsed, _ = timed_pull(node, uri)
    check(node, uri, files)
    assert elapsed < 2 * STALL, elapsed
    assert stats(node, uri).from_origin == sum(map(len, files.values()))
    # Its Retry-After is honoured, and once a piece went past its budget it is left alone.
    assert byz.asked["503"] <= 2 * STALL, byz.asked


def test_a_slow_honest_peer_gives_way_to_a_faster_origin(make_node, byzantine, model):
    # F7: a seed at 256 KiB/s and an origin that answers at once: every piece used to come from
    # the seed, and a piece slower than the stall timeout failed the pull after reading the model
    # three times from the peer.
    uri, files = model
    byzantine(Lies(rate=256 << 10))
    node = make_node("victim", witnesses=1)
    elapsed, _ = timed_pull(node, uri)
    check(node, uri, files)
    s = stats(node, uri)
    assert s.from_origin > 0 and elapsed < 2 * STALL, (s, elapsed)
    # What it reports from peers is what made it into the model, not what was read and dropped.
    assert s.from_origin + s.from_peers <= sum(map(len, files.values())) + 2 * MiB


def test_a_member_claiming_every_piece_costs_one_budget_not_one_per_piece(make_node, byzantine, model):
    # F8: a member whose have replies claim it reads every piece from the origin, and never does:
    # each piece used to wait --peer-wait for it.
    uri, files = model
    byzantine(Lies(claim_all=True), complete=False)
    node = make_node("victim", wait=20.0, witnesses=1)
    elapsed, _ = timed_pull(node, uri)
    check(node, uri, files)
    assert elapsed < 2 * STALL, elapsed


def test_have_replies_are_bounded_while_they_are_read(make_node, byzantine, model, tmp_path):
    # F4: a have reply of 512 MiB was read whole before a 64 MiB cap applied (640 MiB RSS); piece
    # indices were unbounded (1,000,000 entries for a 2-piece model).
    uri, files = model
    key = storage_key(uri)
    geometry = Geometry(MiB, tuple(piece_count(len(files[p]), MiB) for p in sorted(files)))
    digest = "0" * 32
    client = PeerClient(lambda: TOKEN)
    giant = byzantine(Lies(giant_have=512 << 20), name="giant")
    rss = _rss()
    started = time.monotonic()
    with pytest.raises(PeerError, match=r"have reply of 536870912 bytes, more than the \d+ a model of 8 pieces"):
        client.have(giant.info(), key, digest, geometry, "-", 0, 0)
    assert time.monotonic() - started < 5 and _rss() - rss < 32 << 20
    bogus = byzantine(Lies(bogus_indices=True), name="bogus")
    with pytest.raises(PeerError, match="malformed"):
        client.have(bogus.info(), key, digest, geometry, "-", 0, 0)
    client.close()
    # In a pull: neither peer is used, and the model comes whole from the origin.
    node = make_node("victim")
    timed_pull(node, uri)
    check(node, uri, files)
    assert stats(node, uri).from_peers == 0 and giant.asked["have"] >= 1 and bogus.asked["have"] >= 1


def test_a_peer_serving_wrong_bytes_is_excluded_after_its_first_bad_piece_and_never_asked_again(
        make_node, byzantine, model, tmp_path):
    uri, files = model
    byz = byzantine(Lies(flip=True))
    node = make_node("victim", witnesses=1)
    timed_pull(node, uri, workers=1)
    check(node, uri, files)
    assert byz.asked["piece"] == 1 and stats(node, uri).dropped == ("byz",)
    assert node.network.excluded("byz")
    # Kept in the store: an agent restarted on this root still excludes it, for a day.
    again = PeerNetwork(node.network.settings, node.network.directory, node.network.client, NodeStore.at(node.root))
    (item,) = again.exclusions.items()
    assert item.node == "byz" and "has sha-256" in item.reason and 23.9 * 3600 < item.until - item.since <= 24 * 3600
    # A later pull, of another model: the peer is not even polled.
    other = make_source(tmp_path / "other", {"c.bin": 3 * MiB})
    asked = dict(byz.asked)
    timed_pull(node, f"file://{tmp_path / 'other'}")
    check(node, f"file://{tmp_path / 'other'}", other)
    assert byz.asked == asked


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0



# ---- whose word a piece is checked against (F1) --------------------------------------------------


def test_a_lone_liar_gets_no_forged_byte_into_a_model_without_source_checksums(make_node, byzantine, model):
    # F1 (a): a peer advertising the sha-256 of its own wrong bytes, alone: a file:// pull
    # published its bytes, sealed its hashes in the piece record, and served them on.
    uri, files = model
    byz = byzantine(Lies(forge=True))
    node = make_node("victim")
    timed_pull(node, uri)
    check(node, uri, files)
    assert stats(node, uri).from_peers == 0 and byz.asked["piece"] == 0
    # Its word was compared with the first piece read from the origin: excluded, for good.
    assert node.network.excluded("byz")
    record = PieceRecord.from_json(NodeStore.at(node.root).pieces_text(storage_key(uri)) or "")
    for path, body in files.items():
        assert record.files[path] == [hash_piece(body[i:i + MiB]) for i in range(0, max(1, len(body)), MiB)]
        assert record.sources[path] == "o" * len(record.files[path])  # what it witnesses to others


def test_witnesses_that_disagree_are_settled_by_the_origin_and_the_liar_is_excluded(make_node, byzantine, model):
    # Even taking one node's word (witnesses=1): a second node that says it read the same pieces
    # from the origin with other hashes makes the origin decide, and the liar is found at once.
    uri, files = model
    seed = make_node("seed", witnesses=1)
    timed_pull(seed, uri)  # alone: every piece from the origin, a witness of each
    byz = byzantine(Lies(forge=True))
    node = make_node("victim", witnesses=1)
    timed_pull(node, uri)
    check(node, uri, files)
    assert node.network.excluded("byz") and not node.network.excluded("seed")
    assert byz.asked["piece"] == 0  # a disputed witness is never asked for bytes
    assert stats(node, uri).from_peers > 0  # what was not disputed any more came from the seed


def test_a_liar_is_found_by_a_files_checksum_and_never_asked_again(make_node, byzantine, nginx, tmp_path):
    # F1 (c): a source checksum refused the liar's file, which was read again from the origin,
    # but the liar was never dropped: every later pull used it again and paid the model twice.
    body = nginx.write("m/model.bin", 4 * MiB + 99).read_bytes()
    uri = nginx.url("m/model.bin") + "#sha256=" + hashlib.sha256(body).hexdigest()
    byz = byzantine(Lies(forge=True), files={"model.bin": body})
    node = make_node("victim")  # the default two witnesses: a checked file needs none but the file check
    timed_pull(node, uri)
    assert (node.root / "models" / storage_key(uri) / "model.bin").read_bytes() == body
    assert node.network.excluded("byz") and byz.asked["piece"] >= 1
    s = stats(node, uri)
    assert s.from_peers == 0 and s.from_origin >= len(body)  # the liar's bytes were of no use
    asked = dict(byz.asked)
    other = nginx.write("m/other.bin", MiB).read_bytes()
    timed_pull(node, nginx.url("m/other.bin") + "#sha256=" + hashlib.sha256(other).hexdigest())
    assert byz.asked == asked


def test_honest_nodes_that_passed_on_a_liars_pieces_are_not_excluded_only_the_liar(make_node, byzantine, nginx,
                                                                                    directory):
    # A liar that says it read a checked file from the origin (forged hashes), and three honest
    # nodes that pull together: they take its pieces and pass them on to each other before their
    # file checks fail. Each then read the file again from the origin and compared: every node
    # used to exclude every other (the relays' vouches differed from the origin too), and publish
    # them, so that the rest of the cluster skipped every honest peer for a day.
    body = nginx.write("m/model.bin", 8 * MiB + 99).read_bytes()
    uri = nginx.url("m/model.bin") + "#sha256=" + hashlib.sha256(body).hexdigest()
    byz = byzantine(Lies(forge=True), files={"model.bin": body})
    nodes = [make_node(n) for n in ("n1", "n2", "n3")]
    pull_all(nodes, uri, workers=2)
    assert byz.asked["piece"] >= 1
    for node in nodes:
        assert (node.root / "models" / storage_key(uri) / "model.bin").read_bytes() == body
        assert [e.node for e in node.network.exclusions.items()] == ["byz"], node.name
    # A node that joins later skips whom the others excluded (what agent/peering.py's Directory
    # does with their statuses) and is filled by the honest ones: no byte from the origin.
    for name in {e.node for node in nodes for e in node.network.exclusions.items()}:
        directory.pop(name)
    late = make_node("late")
    pull_all([late], uri)
    assert stats(late, uri).from_origin == 0
    assert (late.root / "models" / storage_key(uri) / "model.bin").read_bytes() == body


def gcs_model(gcs: GCSServer, files: dict[str, bytes]) -> tuple[str, Settings]:
    bucket = gcs.client().bucket(gcs.new_bucket())
    for name, body in files.items():
        bucket.blob(f"m/{name}").upload_from_string(body)
    return f"gs://{bucket.name}/m", Settings.from_env(gcs.env())


def test_a_liar_keeping_a_gcs_files_crc32c_gets_no_byte_in_and_is_never_asked_again(make_node, byzantine,
                                                                                   gcs_emulator):
    # GCS gives every object a crc32c, and whoever knows a file can make other bytes with the same
    # one (tests/byzantine.py: crc32c_kept). Here a liar serves such bytes under their own sha-256s.
    import google_crc32c

    files = {"a.bin": os.urandom(3 * MiB + 5), "config.json": os.urandom(300)}
    uri, settings = gcs_model(gcs_emulator, files)
    byz = byzantine(Lies(forge=True, keep_crc32c=True), files=files)
    for path, body in files.items():
        assert google_crc32c.value(byz.wrong[path]) == google_crc32c.value(body) and byz.wrong[path] != body
    node = make_node("victim")  # the default two witnesses: a GCS file needs none but its md5
    timed_pull(node, uri, settings=settings)
    check(node, uri, files)  # 0 wrong bytes: the object's md5 refused what its crc32c let through
    assert node.network.excluded("byz") and byz.asked["piece"] >= 1
    assert stats(node, uri).from_peers == 0
    asked = dict(byz.asked)
    other = {"b.bin": os.urandom(MiB + 3)}
    uri2, _ = gcs_model(gcs_emulator, other)
    timed_pull(node, uri2, settings=settings)
    check(node, uri2, other)
    assert byz.asked == asked


def test_a_group_reads_a_gcs_model_from_the_origin_once(make_node, gcs_emulator):
    # GCS objects carry an md5 beside their crc32c: with peer transfer it is listed, so a group
    # trusts the file check and reads each piece from the origin once (a crc32c alone would make
    # the files unchecked: each piece read by two witnesses, the model twice).
    files = {"a.bin": os.urandom(4 * MiB + 9), "b.bin": os.urandom(2 * MiB), "config.json": os.urandom(200)}
    uri, settings = gcs_model(gcs_emulator, files)
    # The agent's own formation window (3 s): the two listings, which the emulator answers slowly on
    # a loaded machine, end within it, so each node counts the other as a member from the start.
    nodes = [make_node(n, formation=3.0) for n in ("n1", "n2")]
    pull_all(nodes, uri, settings=settings)
    size = sum(map(len, files.values()))
    origin = sum(stats(n, uri).from_origin for n in nodes)
    assert size <= origin <= 1.2 * size, (origin, size)
    for node in nodes:
        check(node, uri, files)


# ---- the server under hostile load ------------------------------------------------------------------


def flood(port: int, count: int, sources: int, mode: str) -> subprocess.Popen[str]:
    """``count`` slow unauthenticated connections from another process (tests/peer_flood.py)."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.peer_flood", "127.0.0.1", str(port), str(count),
                             str(sources), mode], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("opened"), line
    return proc


def alive(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    return int(proc.stdout.readline().split()[1])


@pytest.mark.parametrize("sources", [1, 10])
def test_a_thousand_slow_unauthenticated_connections_cost_bounded_threads_and_memory(make_node, model, sources):
    # F5: each half-sent request held a thread for ever (1,000 connections: 1,002 threads, RSS
    # 40 -> 120 MiB); authorize() was never even called.
    from modelcache.peers.server import MAX_CONNECTIONS, MAX_PER_CLIENT

    uri, files = model
    seed = make_node("seed")
    timed_pull(seed, uri)
    threads, rss = threading.active_count(), _rss()
    proc = flood(seed.server.port, 1000, sources, "head")
    try:
        # Connections, and so threads, stay under the caps; memory with them.
        cap = min(MAX_CONNECTIONS, sources * MAX_PER_CLIENT)
        assert seed.server.gate.count() <= cap and alive(proc) <= cap
        grown_threads, grown_rss = threading.active_count() - threads, _rss() - rss
        assert grown_threads <= cap + 2 and grown_rss < 64 << 20, (grown_threads, grown_rss)
        # An agent (another address) is served all the same, every byte from the peer (one witness
        # is enough for it: what is tested here is the server).
        late = make_node("late", witnesses=1)
        timed_pull(late, uri)
        check(late, uri, files)
        assert stats(late, uri).from_origin == 0
        print(f"\n{sources} source(s): {grown_threads} threads, {grown_rss >> 20} MiB more; {alive(proc)} of 1000 "
              f"connections open")
    finally:
        proc.kill()
        proc.wait()


def test_a_request_head_dribbled_byte_by_byte_is_cut_at_its_deadline(make_node, model, monkeypatch):
    # F5: the idle timeout was per read: a request line at one byte every 59 s held its thread for ever.
    import modelcache.peers.server as server_mod

    monkeypatch.setattr(server_mod, "HEAD_TIMEOUT", 2.0)
    seed = make_node("seed")
    proc = flood(seed.server.port, 20, 1, "drip")
    try:
        started = time.monotonic()
        while alive(proc) and time.monotonic() - started < 10:
            pass
        assert alive(proc) == 0 and time.monotonic() - started < 5
        assert seed.server.gate.count() == 0
    finally:
        proc.kill()
        proc.wait()


def test_one_client_never_holds_every_upload_slot_and_a_stalled_reader_frees_its_slot(make_node, model,
                                                                                      monkeypatch):
    # F12: four slow readers (one node, say) held every upload slot for as long as they liked.
    import modelcache.peers.server as server_mod

    monkeypatch.setattr(server_mod, "UPLOAD_MIN_TIME", 1.0)
    monkeypatch.setattr(server_mod, "UPLOAD_MIN_RATE", 64 << 20)
    uri, _ = model
    seed = make_node("seed", max_uploads=4)
    timed_pull(seed, uri)
    assert all(seed.server.take_upload("10.0.0.9") for _ in range(3))
    assert not seed.server.take_upload("10.0.0.9")  # a fourth for the same client: busy
    assert seed.server.take_upload("10.0.0.8")  # another client still gets one
    assert not seed.server.take_upload("10.0.0.7")  # every slot taken
    for addr in ("10.0.0.9", "10.0.0.9", "10.0.0.9", "10.0.0.8"):
        seed.server.release_upload(addr)
    # A reader that stops reading: its upload ends by its deadline, the slot is free again.
    key = storage_key(uri)
    digest = seed.network.stats(key).listing_digest
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    raw = socket.create_connection(("127.0.0.1", seed.server.port))
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock = ctx.wrap_socket(raw)
    sock.sendall(f"GET /v1/models/{key}/{digest}/files/0 HTTP/1.1\r\nHost: x\r\nRange: bytes=0-{4 * MiB - 1}\r\n"
                 f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
    sock.recv(100)
    started = time.monotonic()
    while seed.server.uploads_in_flight and time.monotonic() - started < 10:
        time.sleep(0.05)
    assert seed.server.uploads_in_flight == 0 and time.monotonic() - started < 5
    sock.close()


def test_the_server_follows_no_symlink_out_of_a_model_folder(make_node, model, tmp_path):
    # F11: a.bin replaced by a link to another file was served (206 b'TOP-SECRET ...').
    from modelcache.peers.client import PeerGone

    uri, files = model
    seed = make_node("seed")
    timed_pull(seed, uri)
    key = storage_key(uri)
    digest = seed.network.stats(key).listing_digest
    secret = tmp_path / "secret"
    secret.write_bytes(b"TOP-SECRET " * (len(files["a.bin"]) // 11 + 1))
    folder = seed.root / "models" / key
    client = PeerClient(lambda: TOKEN)
    buf = memoryview(bytearray(16))
    assert client.read(seed.info, key, digest, 0, 0, 16, buf, time.monotonic() + 10) == 16  # a.bin: path order 0
    (folder / "a.bin").unlink()
    (folder / "a.bin").symlink_to(secret)
    with pytest.raises(PeerGone):
        client.read(seed.info, key, digest, 0, 0, 16, buf, time.monotonic() + 10)
    assert bytes(buf) == files["a.bin"][:16]
    client.close()
