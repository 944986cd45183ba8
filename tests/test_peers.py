"""Peer transfer's parts without a cluster (modelcache/peers): piece records, the protocol's strict
parsing, what a node serves of a download in flight, the server's limits, and swarms of pulls in
one process over real TLS sockets (the directory is a list; agents on the real control plane are
in tests/test_agent_peers.py)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import urllib3

from modelcache.engine.transfer import TransferOptions
from modelcache.peers.client import PeerBusy, PeerClient
from modelcache.peers.local import LocalPieces
from modelcache.peers.pieces import (
    PIECE_MAX,
    PieceHash,
    PieceLog,
    PieceRecord,
    hash_piece,
    listing_digest,
    piece_size_for,
)
from modelcache.peers.protocol import Geometry, HaveReply, have_path, parse_path, parse_range
from modelcache.peers.server import (
    TokenBucket,
)
from modelcache.pull import pull
from modelcache.sources.base import Checksum, RemoteFile
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from modelcache.store.journal import Journal, JournalState
from tests.helpers import wait_until
from tests.peer_util import TOKEN, MiB, Node, check, make_source, node_factory, pull_all

# ---- pieces and records ------------------------------------------------------------------------


def test_piece_size_divides_the_chunk_and_stays_small():
    assert piece_size_for(16 * MiB) == PIECE_MAX == 4 * MiB
    assert piece_size_for(1 * MiB) == 1 * MiB
    assert piece_size_for(6 * MiB) == 6 * MiB  # 4 MiB would straddle chunks


def test_listing_digest_names_exactly_what_is_fetched():
    a = [RemoteFile("a.bin", 10, "v1", (Checksum("sha256", "00" * 32),)), RemoteFile("b.bin", 5, "v1")]
    assert listing_digest("s3://b/p", a) == listing_digest("s3://b/p", list(reversed(a)))  # order of the listing
    assert listing_digest("s3://b/p", a) != listing_digest("s3://b/p", [a[0], RemoteFile("b.bin", 5, "v2")])
    assert listing_digest("s3://b/p", a) != listing_digest("s3://b/q", a)


def test_piece_log_resumes_its_hashes_and_ignores_damage(tmp_path):
    path = str(tmp_path / "pieces")
    log = PieceLog(path, MiB, "d" * 32)
    log.open(fresh=True)
    log.add(0, 0, PieceHash("a" * 64, True))
    log.add(0, 1, PieceHash("b" * 64, False))
    log.add(1, 0, PieceHash("c" * 64, True))
    log.reset(0)  # file 0 fetched again: its hashes are gone
    log.add(0, 0, PieceHash("d" * 64, False))
    log.close()
    with open(path, "a") as f:
        f.write("h 2 0 " + "e" * 64 + " o *00000000\n")  # a damaged seal
        f.write("h 2 1 " + "f" * 64)  # torn last line
    assert PieceLog(path, MiB, "d" * 32).load() == {(1, 0): PieceHash("c" * 64, True),
                                                    (0, 0): PieceHash("d" * 64, False)}
    assert PieceLog(path, 2 * MiB, "d" * 32).load() == {}  # another piece size: nothing carries over
    assert PieceLog(path, MiB, "e" * 32).load() == {}  # another listing


def test_piece_record_is_sealed_and_checked():
    record = PieceRecord("0123456789abcdef", "d" * 32, MiB, {"a.bin": ["a" * 64, "b" * 64]}, 10, 20)
    assert PieceRecord.from_json(record.to_json()) == record
    doc = json.loads(record.to_json())
    doc["files"]["a.bin"][0] = "c" * 64
    with pytest.raises(ValueError, match="seal"):
        PieceRecord.from_json(json.dumps(doc))


def test_protocol_parsing_is_strict():
    assert parse_path(f"/v1/models/{'a' * 16}/{'b' * 32}/files/3").file == 3  # type: ignore[union-attr]
    assert parse_path(f"/v1/models/{'a' * 16}/{'b' * 32}/have").kind == "have"  # type: ignore[union-attr]
    for bad in ("/v1/models/../etc/have", f"/v1/models/{'a' * 16}/{'b' * 32}/files/-1", "/metrics"):
        assert parse_path(bad) is None
    assert parse_range("bytes=0-1023") == (0, 1024)
    assert parse_range("bytes=5-") is None and parse_range("bytes=0-1,4-5") is None and parse_range("bytes=9-3") is None
    good = HaveReply("e.0", 2, MiB, False, True, [(0, 0, "a" * 64, True)], [(1, 2)])
    geometry = Geometry(MiB, (1, 3))
    assert HaveReply.from_json(good.to_json(), geometry) == good
    for doc in ({"epoch": "e", "seq": 1, "pieceSize": MiB, "pieces": [[5, 0, "a" * 64, 1]]},  # file out of range
                {"epoch": "e", "seq": 1, "pieceSize": MiB, "pieces": [[0, 0, "xyz", 1]]},  # not a sha-256
                {"epoch": "e", "seq": -1, "pieceSize": MiB},
                {"epoch": "e", "seq": 1, "pieceSize": 0}):
        with pytest.raises(ValueError):
            HaveReply.from_json(json.dumps(doc).encode(), geometry)


# ---- what a download in flight serves ------------------------------------------------------------


def test_a_piece_is_served_once_hashed_and_written_and_withdrawn_when_its_file_is_fetched_again(tmp_path):
    files = [RemoteFile("b.bin", 3 * MiB, "v"), RemoteFile("a.bin", MiB + 10, "v")]  # "a.bin" first by path
    data = tmp_path / "data"
    data.mkdir()
    for f in files:
        (data / f.path).write_bytes(os.urandom(f.size or 0))
    log = PieceLog(str(tmp_path / "pieces"), MiB, "d" * 32)
    log.open(fresh=True)
    local = LocalPieces(files, data, 2 * MiB, MiB, log, JournalState())
    journal = Journal(str(tmp_path / "journal"))
    journal.open(fresh=True)
    journal.listener = local

    local.record(0, 0, PieceHash("a" * 64, True))
    assert local.have("-", 0, 0).pieces == []  # hashed, not yet written
    journal.chunk(0, 0, MiB // 2)
    assert local.have("-", 0, 0).pieces == []  # half written
    journal.chunk(0, 0, MiB)
    first = local.have("-", 0, 0)
    assert first.full and first.pieces == [(1, 0, "a" * 64, True)]  # b.bin is file 1 in path order
    assert local.range(1, 0, MiB) is not None and local.range(1, 0, MiB + 1) is None
    assert local.range(0, 0, 10) is None  # nothing of a.bin yet

    journal.chunk(0, 1, MiB)  # written, not yet hashed (bytes 3-4 MiB)
    local.claim(0, range(1, 2))
    news = local.have(first.epoch, first.seq, 5.0)  # returns at once: a claim changed
    assert not news.full and news.pieces == [] and news.fetching == [(1, 1)]
    waiter: list[HaveReply] = []
    t = threading.Thread(target=lambda: waiter.append(local.have(first.epoch, first.seq, 5.0)))
    t.start()
    local.record(0, 2, PieceHash("c" * 64, False))
    t.join()
    assert waiter[0].pieces == [(1, 2, "c" * 64, False)]

    served = local.range(1, 0, MiB)
    assert served is not None and callable(served.make_durable)  # written since the last flush
    served.make_durable()  # type: ignore[operator]
    assert local.range(1, 0, MiB).make_durable is None  # type: ignore[union-attr]

    journal.file_reset(0)
    after = local.have(first.epoch, first.seq, 0)
    assert after.full and after.epoch != first.epoch and after.pieces == []
    assert local.range(1, 0, MiB) is None
    journal.close()


def test_a_reply_wakes_the_waiting_streams_only_when_it_speaks_of_a_piece_they_wait_for(tmp_path):
    # Each poll's reply woke every stream waiting for a piece, most of them to find nothing new
    # (16 agents hear ~14 replies a second each). A reply now wakes them when it is whole, changes
    # the members, or says a piece they wait for is held or read from the origin (or no longer
    # read); any other waits for their next look (0.2 s).
    from modelcache.peers.client import PeerInfo
    from modelcache.peers.settings import SwarmSettings
    from modelcache.peers.swarm import PeerLink, SwarmSession

    files = [RemoteFile("a.bin", 4 * MiB, "v")]
    data = tmp_path / "data"
    data.mkdir()
    log = PieceLog(str(tmp_path / "pieces"), MiB, "d" * 32)
    log.open(fresh=True)
    local = LocalPieces(files, data, MiB, MiB, log, JournalState())
    session = SwarmSession(SwarmSettings(node="me"), "0" * 16, "d" * 32, local, PeerClient(lambda: TOKEN),
                           lambda key: [], lambda node: False, lambda node, why: None)
    link = PeerLink(session, PeerInfo("p", "127.0.0.1", 1, "0" * 64))
    session.links["p"] = link
    session.plan.add(link.state)
    woken: list[int] = []
    notify = session.cond.notify_all
    session.cond.notify_all = lambda: (woken.append(1), notify())[1]  # type: ignore[method-assign]

    def reply(seq: int, full: bool, pieces: list[int], fetching: list[int]) -> bool:
        woken.clear()
        session.apply(link, HaveReply("e", seq, MiB, False, full, [(0, p, f"{p:064x}", True) for p in pieces],
                                      [(0, p) for p in fetching]))
        return bool(woken)

    assert reply(1, True, [0], [])  # everything it holds: a new peer's word
    session._awaited[(0, 2)] = 1  # a stream waits for piece 2
    assert not reply(2, False, [1], [])  # another piece
    assert reply(3, False, [], [2])  # it reads piece 2 from the origin now
    assert not reply(3, False, [], [2])  # still
    assert reply(3, False, [], [])  # no longer
    assert reply(4, False, [2], [])  # it holds piece 2
    assert session.plan.holders[(0, 2)] == {"p"}
    log.close()


# ---- the server ----------------------------------------------------------------------------------


@pytest.fixture
def make_node(tmp_path) -> Iterator[Callable[..., Node]]:
    """Nodes that take one witness's word for a piece (``witnesses=1``): the swarm's mechanics on
    a local folder, whose files have no source checksum. With the default of two, such files are
    read twice from the origin (tests/test_peers_adversarial.py shows why, and this file's first
    test what it costs)."""
    made = node_factory(tmp_path)
    make = next(made)

    def one_witness(*args: object, **kw: object) -> Node:
        return make(*args, **{"witnesses": 1, **kw})

    yield one_witness
    next(made, None)


@pytest.mark.parametrize("witnesses", [1, 2])
def test_three_pulls_that_start_together_read_every_piece_from_the_origin_once(make_node, tmp_path, witnesses):
    files = make_source(tmp_path / "src", {"a.bin": 3 * MiB, "b.bin": 5 * MiB + 123, "config.json": 100})
    uri = f"file://{tmp_path / 'src'}"
    nodes = [make_node(n, witnesses=witnesses) for n in ("n1", "n2", "n3")]
    pull_all(nodes, uri)
    size = sum(map(len, files.values()))
    stats = {n.name: n.network.stats(storage_key(uri)) for n in nodes}
    # Once per piece and witness (the files have no source checksum), but for a few read once more
    # when a slow first poll outlasts the formation window.
    origin = sum(s.from_origin for s in stats.values())  # type: ignore[union-attr]
    assert witnesses * size <= origin <= (witnesses + 0.2) * size, (origin, size)
    for node in nodes:
        check(node, uri, files)
        s = stats[node.name]
        assert s.from_origin + s.from_peers >= size  # type: ignore[union-attr]
        record = PieceRecord.from_json(NodeStore.at(node.root).pieces_text(storage_key(uri)) or "")
        assert record.files["a.bin"] == [hash_piece(files["a.bin"][i * MiB:(i + 1) * MiB]) for i in range(3)]
        assert (record.bytes_from_origin, record.bytes_from_peers) == (s.from_origin, s.from_peers)  # type: ignore


def test_a_published_model_is_served_whole_and_a_late_node_reads_nothing_from_the_origin(make_node, tmp_path):
    files = make_source(tmp_path / "src", {"a.bin": 2 * MiB + 5, "b.bin": 10})
    uri = f"file://{tmp_path / 'src'}"
    seed = make_node("seed")
    pull_all([seed], uri)
    assert seed.network.stats(storage_key(uri)).from_origin == 2 * MiB + 15  # type: ignore[union-attr]
    late = make_node("late")
    pull_all([late], uri)
    check(late, uri, files)
    s = late.network.stats(storage_key(uri))
    assert (s.from_origin, s.from_peers) == (0, 2 * MiB + 15)  # type: ignore[union-attr]


def test_a_polls_reply_comes_whole_in_one_tls_record(make_node, tmp_path):
    # Its head and body were two sends, so two TLS records and two wake-ups of the polling thread
    # for every poll; one send is one record, which the first read returns whole.
    import ssl

    make_source(tmp_path / "src", {"a.bin": 2 * MiB + 5})
    uri = f"file://{tmp_path / 'src'}"
    seed = make_node("seed")
    pull_all([seed], uri)
    key = storage_key(uri)
    digest = seed.network.stats(key).listing_digest  # type: ignore[union-attr]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", seed.server.port), timeout=10)) as sock:
        bodies = []
        for target in (f"{have_path(key, digest)}?epoch=-&since=0&wait=0", f"{have_path(key, 'f' * 32)}?wait=0"):
            sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
            head, _, body = sock.recv(1 << 16).partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            assert len(body) == length, (head, body)
            bodies.append(body)
    assert len(HaveReply.from_json(bodies[0], Geometry(MiB, (3,))).pieces) == 3
    assert bodies[1] == b"model not held\n"


def test_the_server_refuses_without_a_token_and_sends_busy_beyond_its_upload_slots(make_node, tmp_path):
    files = make_source(tmp_path / "src", {"a.bin": MiB})
    uri = f"file://{tmp_path / 'src'}"
    seed = make_node("seed", max_uploads=1, upload_rate=256 << 10)
    pull_all([seed], uri)
    key = storage_key(uri)
    digest = seed.network.stats(key).listing_digest  # type: ignore[union-attr]
    pool = urllib3.HTTPSConnectionPool("127.0.0.1", seed.server.port, cert_reqs="CERT_NONE", assert_hostname=False,
                                       assert_fingerprint=seed.info.fingerprint, retries=False, maxsize=4)
    # A long poll answered is counted (the agent's modelcache_agent_peer_polls_answered, which
    # bench/fleet.py reads); one for a model not held is not.
    polls: list[str] = []
    seed.server.on_poll = lambda: polls.append(key)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert pool.urlopen("GET", f"{have_path(key, digest)}?epoch=-&since=0&wait=0", headers=bearer).status == 200
    assert pool.urlopen("GET", f"{have_path(key, 'f' * 64)}?epoch=-&since=0&wait=0", headers=bearer).status == 404
    assert polls == [key]
    # Replies leave at once: with Nagle's algorithm a reply's body waited for the ACK of its head,
    # which the client delays (40 ms on Linux: a poll took 48 ms on localhost, bench/poll_cost.py).
    conns = list(seed.server.gate._open.values())
    assert conns and all(e.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for e in conns)
    path = f"/v1/models/{key}/{digest}/files/0"
    assert pool.urlopen("GET", path, headers={"Range": "bytes=0-9"}).status == 401
    assert pool.urlopen("GET", path, headers={"Range": "bytes=0-9", "Authorization": "Bearer other"}).status == 403

    client = PeerClient(lambda: TOKEN)
    slow: list[int] = []
    buf = memoryview(bytearray(MiB))
    t = threading.Thread(target=lambda: slow.append(client.read(seed.info, key, digest, 0, 0, MiB, buf,
                                                                time.monotonic() + 30)))
    t.start()  # 1 MiB at 256 KiB/s holds the only upload slot for ~4 s
    deadline = time.monotonic() + 10
    while not seed.server.uploads_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(PeerBusy):
        client.read(seed.info, key, digest, 0, 0, 1024, memoryview(bytearray(1024)), time.monotonic() + 30)
    t.join(30)
    assert slow == [MiB] and bytes(buf) == files["a.bin"]


class VirtualTime:
    """A clock and a sleep that only move each other: rates checked without timing anything."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += 1
        self.now += seconds


def test_the_upload_rate_holds_every_upload_together_to_its_bytes_per_second():
    t = VirtualTime()
    bucket = TokenBucket(256 << 10, t.clock, t.sleep)
    for _ in range(16):
        bucket.take(64 << 10)  # 1 MiB at 256 KiB/s
    assert 3.99 <= t.now <= 4.01
    # An idle spell banks at most one send block (a short burst), not a minute of credit.
    t.now += 60
    start = t.now
    for _ in range(16):
        bucket.take(64 << 10)
    assert 2.99 <= t.now - start <= 4.01
    unlimited = TokenBucket(0, t.clock, t.sleep)
    slept = t.slept
    unlimited.take(1 << 30)
    assert t.slept == slept


@pytest.mark.parametrize("kernel_tls", [False, True], ids=["user-space-tls", "sendfile"])
def test_a_range_is_served_at_the_upload_rate_by_either_send_path(make_node, tmp_path, monkeypatch, kernel_tls):
    # kTLS needs Python 3.14+ with a kernel tls module (not this test machine's): the sendfile path is
    # forced here; socket.sendfile then sends through the TLS socket as the kernel would encrypt it.
    import modelcache.peers.server as server_mod

    files = make_source(tmp_path / "src", {"a.bin": 3 * MiB + 11})
    uri = f"file://{tmp_path / 'src'}"
    seed = make_node("seed", upload_rate=512 << 10)
    pull_all([seed], uri)
    assert seed.server.bucket.rate == 512 << 10
    t = VirtualTime()
    seed.server.bucket = TokenBucket(512 << 10, t.clock, t.sleep)
    if kernel_tls:
        monkeypatch.setattr(server_mod, "ktls_send", lambda conn: True)
    key = storage_key(uri)
    digest = seed.network.stats(key).listing_digest  # type: ignore[union-attr]
    buf = memoryview(bytearray(MiB + 5))
    start = 2 * MiB + 6  # a range across pieces, not at a block boundary
    assert PeerClient(lambda: TOKEN).read(seed.info, key, digest, 0, start, start + len(buf), buf,
                                         time.monotonic() + 60) == len(buf)
    assert bytes(buf) == files["a.bin"][start:start + len(buf)]
    # The server counts a zero-copy send after its last byte, which the client may have read first
    # (seen at load 51: 0 == 1).
    if kernel_tls:
        wait_until(lambda: seed.server.zero_copy_sends == 1, timeout=10, what="the zero-copy send counted")
    assert seed.server.zero_copy_sends == (1 if kernel_tls else 0)
    assert 1.99 <= t.now <= 2.01  # 1 MiB at 512 KiB/s, on the upload clock


def test_a_pull_from_peers_reuses_its_piece_buffers_and_every_byte_is_still_the_sources(make_node, tmp_path,
                                                                                        monkeypatch):
    # A fresh piece buffer per stream costs its pages faulted in and zeroed each time (9.7 % of an
    # agent's CPU in bench/fleet.py's 16 agents): closed streams hand theirs on. Reused buffers must
    # never carry a byte of an earlier piece into a later one.
    from modelcache.peers.source import PeerSource

    files = make_source(tmp_path / "src", {"a.bin": 5 * MiB + 3, "b.bin": 3 * MiB, "c.bin": 7})
    uri = f"file://{tmp_path / 'src'}"
    seed = make_node("seed")
    pull_all([seed], uri)
    made: list[int] = []
    take = PeerSource.take_buffer

    def counted(self: PeerSource) -> bytearray:
        with self._spare_lock:
            spare = len(self._spare)
        buf = take(self)
        if not spare:
            made.append(len(buf))
        return buf

    monkeypatch.setattr(PeerSource, "take_buffer", counted)
    late = make_node("late")
    pull_all([late], uri, workers=1)
    check(late, uri, files)
    stats = late.network.stats(storage_key(uri))
    assert stats is not None and stats.from_origin == 0 and stats.from_peers == sum(map(len, files.values()))
    assert made == [MiB]  # a stream per 1 MiB chunk (a piece each), one after another: one buffer


def test_the_server_reads_ahead_exactly_the_range_it_serves(make_node, tmp_path, monkeypatch):
    # The kernel's readahead past a range of a download in flight makes ext4 zero page-cache pages
    # for the preallocated, unwritten rest of the file (6 % of an agent's CPU in bench/fleet.py).
    import modelcache.peers.server as server_mod

    files = make_source(tmp_path / "src", {"a.bin": 3 * MiB + 11})
    uri = f"file://{tmp_path / 'src'}"
    seed = make_node("seed")
    pull_all([seed], uri)
    advice: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, how: int) -> None:
        advice.append((offset, length, how))
        real(fd, offset, length, how)

    monkeypatch.setattr(server_mod.os, "posix_fadvise", fadvise)
    key = storage_key(uri)
    digest = seed.network.stats(key).listing_digest  # type: ignore[union-attr]
    buf = memoryview(bytearray(MiB + 5))
    start = 2 * MiB + 6
    assert PeerClient(lambda: TOKEN).read(seed.info, key, digest, 0, start, start + len(buf), buf,
                                         time.monotonic() + 60) == len(buf)
    assert bytes(buf) == files["a.bin"][start:start + len(buf)]
    assert advice == [(0, 0, os.POSIX_FADV_RANDOM), (start, len(buf), os.POSIX_FADV_WILLNEED)]


def test_peers_in_our_zone_are_read_from_first(make_node, tmp_path):
    files = make_source(tmp_path / "src", {"a.bin": 4 * MiB, "b.bin": 3 * MiB})
    uri = f"file://{tmp_path / 'src'}"
    near, far = make_node("near", zone="z1"), make_node("far", zone="z2")
    pull_all([near], uri)
    pull_all([far], uri)
    uploaded = {n.name: 0 for n in (near, far)}
    for n in (near, far):
        n.server.on_upload = lambda k, name=n.name: uploaded.__setitem__(name, uploaded[name] + k)
    late = make_node("late", zone="z1")
    pull_all([late], uri)
    check(late, uri, files)
    assert uploaded == {"near": 7 * MiB, "far": 0}


def test_a_resumed_download_keeps_its_piece_hashes_and_publishes_a_complete_record(make_node, tmp_path):
    from modelcache.runtime.progress import ProgressTracker

    files = make_source(tmp_path / "src", {"a.bin": 6 * MiB, "b.bin": 2 * MiB + 7})
    uri = f"file://{tmp_path / 'src'}"
    node = make_node("n1")
    cancel = threading.Event()

    class CancelMidway(ProgressTracker):
        """Cancels the pull after 3 MiB have arrived (and gives the engine time to notice)."""

        def advance(self, key: str, n: int) -> None:
            super().advance(key, n)
            if self.snapshot().bytes_done >= 3 * MiB and not cancel.is_set():
                cancel.set()
                time.sleep(1.0)

    opts = TransferOptions(chunk_size=MiB, workers=1)
    with pytest.raises(Exception, match="cancel"):
        pull(uri, root=node.root, peers=node.network, options=opts, progress=CancelMidway(), cancel=cancel)
    staged = (node.root / ".modelcache" / "staging" / storage_key(uri) / "pieces").read_text()
    assert staged.count("\nh ") >= 2  # hashes of what landed before the cancel are logged
    pull(uri, root=node.root, peers=node.network, options=opts)
    check(node, uri, files)
    record = PieceRecord.from_json(NodeStore.at(node.root).pieces_text(storage_key(uri)) or "")
    for name, body in files.items():
        assert record.files[name] == [hash_piece(body[i:i + MiB]) for i in range(0, len(body), MiB)]
