"""A lying or broken peer cannot poison, wedge, starve or bloat a pull (docs/peers.md, "Trust nothing
from a peer"), without a cluster: real pulls with peer transfer in one process, and a byzantine
peer (tests/byzantine.py) in the directory, over real TLS. Each finding of the peer review
(../shared/PEER-REVIEW.md, F1-F14) that concerns the downloading side is a test here; the same
peer against real agents on the control plane: tests/test_agent_peers_adversarial.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from modelcache.peers.client import PeerClient, PeerError, PeerInfo
from modelcache.peers.pieces import piece_count
from modelcache.peers.protocol import Geometry
from modelcache.pull import pull
from modelcache.transfer import TransferOptions
from modelcache.uri import storage_key
from tests.byzantine import ByzantinePeer, Lies
from tests.peer_util import TOKEN, MiB, Node, check, make_source, node_factory

pytestmark = pytest.mark.timeout(120)

#: A short stall timeout: every bound below scales with it (a piece waits for peers at most half).
STALL = 4.0


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

    def make(lies: Lies, name: str = "byz", complete: bool = True) -> ByzantinePeer:
        peer = ByzantinePeer(name, model[1], MiB, tmp_path / f"tls-{name}", lies)
        directory[name] = peer.info(complete=complete)
        made.append(peer)
        return peer

    yield make
    for peer in made:
        peer.stop()


def timed_pull(node: Node, uri: str, cancel: threading.Event | None = None, **options: Any) -> tuple[float, Any]:
    started = time.monotonic()
    opts = TransferOptions(chunk_size=MiB, workers=options.pop("workers", 2),
                           stall_timeout=options.pop("stall_timeout", STALL), **options)
    result = pull(uri, root=node.root, peers=node.network, options=opts, cancel=cancel)
    return time.monotonic() - started, result


def stats(node: Node, uri: str) -> Any:
    return node.network.stats(storage_key(uri))


@pytest.mark.parametrize("lie", ["tail", "trickle"])
def test_a_peer_that_never_finishes_a_piece_gives_way_to_the_origin(make_node, byzantine, model, lie):
    # F2: the right piece then an endless tail (the client used to drain it), or one byte every
    # two seconds (each read returned in time, the piece never): the pull used to hang for ever.
    uri, files = model
    byz = byzantine(Lies(tail=True) if lie == "tail" else Lies(trickle=2.0))
    node = make_node("victim")
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
    node = make_node("victim", piece_min_time=600.0)  # the read's own deadline is far away
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


def test_a_peer_that_is_busy_for_ever_does_not_starve_the_pull(make_node, byzantine, model):
    # F3: 503 for every piece while advertising all of them: no origin byte in 75 s, failure after
    # ~3 minutes, 18 requests/s at the busy peer.
    uri, files = model
    byz = byzantine(Lies(busy=True))
    node = make_node("victim")
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
    node = make_node("victim")
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
    node = make_node("victim", wait=20.0)
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
    node = make_node("victim")
    timed_pull(node, uri, workers=1)
    check(node, uri, files)
    assert byz.asked["piece"] == 1 and stats(node, uri).dropped == ("byz",)
    assert node.network.excluded("byz")
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
