"""One model's swarm: the peers that have or fetch it, and where each piece comes from.

Membership comes from the directory (the LocalModelNode objects in a cluster): nodes with the
same storage key whose listing digest is ours, or not yet known (they are still listing). Each
is polled (a long poll of its ``have`` endpoint) for the pieces it holds and the pieces it reads
from the origin right now.

Where a piece comes from:

1. A peer that holds it: the one in our zone, with the fewest of our requests in flight. Its
   bytes are checked against the sha-256 it advertised; a peer that sends a wrong piece is
   dropped for this model, and the piece is fetched elsewhere. A peer that fails (gone, reset,
   timeout) costs that piece's request only: the next holder, or the origin, serves it.
2. Else, if nobody reads it from the origin yet and we are its **owner**, the origin. Owners are
   spread by rendezvous hashing of (node, piece) over the members that are still downloading:
   a group that starts together reads each piece from the origin once, then passes it on.
3. Else we wait for the owner, at most ``wait`` seconds, then read it from the origin ourselves.
   While the swarm forms (``formation`` seconds after the start) a member still listing counts
   as an owner, so nodes that start together do not all begin with the origin.

Alone (no member, no holder) every piece comes from the origin at once, as without peers.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from modelcache.errors import TransientError
from modelcache.loop import Loop
from modelcache.peers.client import PeerBusy, PeerClient, PeerError, PeerGone, PeerInfo, PeerRefused
from modelcache.peers.local import LocalPieces
from modelcache.peers.pieces import PieceHash, hash_piece, piece_span

log = logging.getLogger("modelcache.peers")


@dataclass(frozen=True)
class SwarmSettings:
    node: str
    zone: str = ""
    #: Longest wait for a piece that another member should read from the origin.
    wait: float = 20.0
    #: Seconds after the start during which members still listing count as owners.
    formation: float = 3.0
    #: Long-poll length, and the shortest time between two polls of one peer.
    poll_wait: float = 5.0
    poll_gap: float = 0.2
    #: Peers polled per model at most (same zone first).
    max_peers: int = 16
    #: How often the directory is asked who the peers are.
    refresh: float = 0.5


@dataclass
class SwarmStats:
    from_origin: int = 0
    from_peers: int = 0
    bad_pieces: int = 0
    origin_fallbacks: int = 0  # pieces read from the origin after waiting in vain for a peer
    dropped: list[str] = field(default_factory=list)


class PeerLink:
    """What one peer told us about the model, kept current by a polling thread."""

    def __init__(self, session: SwarmSession, info: PeerInfo) -> None:
        self.session, self.info = session, info
        self.have: dict[tuple[int, int], str] = {}
        self.fetching: set[tuple[int, int]] = set()
        self.epoch, self.seq = "-", 0
        self.alive = False  # its last poll succeeded
        self.answered = False  # it answered a poll, even "not held" (a 404: it is still listing)
        self.reachable = True  # its last poll did not fail to connect, time out or break
        self.complete = False
        self.dropped = False
        self.incompatible = False
        self.down_until = 0.0
        self.inflight = 0
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._poll_loop, name=f"peer-poll-{info.name}", daemon=True)

    @property
    def name(self) -> str:
        return self.info.name

    def usable(self, now: float) -> bool:
        return self.alive and not self.dropped and not self.incompatible and now >= self.down_until

    def set_down(self, seconds: float) -> None:
        self.alive = False
        self.down_until = time.monotonic() + seconds
        self.wake.set()

    def _poll_loop(self) -> None:
        s = self.session
        backoff = 0.5
        while not self.stop.is_set():
            wait = 0.0 if self.epoch == "-" or self.complete else s.settings.poll_wait
            try:
                reply = s.client.have(self.info, s.key, s.digest, len(s.local.files), self.epoch, self.seq, wait)
            except PeerRefused as exc:
                self._failed(str(exc), 30.0, reachable=True, warn=True)
            except PeerGone:
                # Not (yet) fetching this listing: still listing (asked again soon, and at once
                # when its status shows the digest), or moved on.
                self._failed("", 0.5, reachable=True)
                continue
            except PeerError as exc:
                self._failed(str(exc), backoff, reachable=False)
            else:
                backoff = 0.5
                s.apply(self, reply)
                if self.complete:  # a seed lists everything once: polled again for liveness, or
                    self.wake.wait(30.0)  # at once after a read from it failed
                    self.wake.clear()
                else:
                    self.stop.wait(s.settings.poll_gap)
                continue
            backoff = min(5.0, backoff * 2)

    def _failed(self, message: str, pause: float, reachable: bool, warn: bool = False) -> None:
        was_alive = self.alive
        self.session.lost(self)
        self.answered = self.answered or reachable
        self.reachable = reachable
        if message and (warn or was_alive):
            (log.warning if warn else log.info)("peer unreachable: %s", message)
        self.wake.wait(pause)  # a stop, a failed read or a new status cut the pause short
        self.wake.clear()


def _rank(node: str, key: str, ci: int, piece: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{node}\0{key}\0{ci}\0{piece}".encode(), digest_size=8).digest(), "big")


class SwarmSession:
    """The peers of one model download and the choice of a source for each of its pieces."""

    def __init__(self, settings: SwarmSettings, key: str, digest: str, local: LocalPieces, client: PeerClient,
                 directory: Callable[[str], list[PeerInfo]], dropped: set[str], workers: int = 8) -> None:
        self.settings, self.key, self.digest, self.local = settings, key, digest, local
        self.workers = max(1, workers)
        self._origin_reads = 0
        self.client, self.directory = client, directory
        self.me = settings.node
        self.stats = SwarmStats()
        self.cond = threading.Condition()
        self.links: dict[str, PeerLink] = {}
        self.holders: dict[tuple[int, int], set[str]] = {}
        self.force_origin: set[int] = set()  # files fetched again after a checksum mismatch
        self.dropped = dropped  # shared with the network: a dropped peer stays dropped for the model
        self.formed_at = time.monotonic() + settings.formation
        self._stop = threading.Event()
        self._refresher = Loop(f"peer-refresh-{key}", self._refresh_quietly, settings.refresh, at_start=False,
                               logger=log)

    def start(self) -> SwarmSession:
        self.refresh()
        self._refresher.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._refresher.stop(timeout=0)  # never waits: a refresh under way sees _stop and returns
        with self.cond:
            links = list(self.links.values())
            self.links.clear()
            self.cond.notify_all()
        for link in links:
            link.stop.set()
            link.wake.set()

    # ---- membership ------------------------------------------------------------------------

    def _refresh_quietly(self) -> None:
        try:
            self.refresh()
        except Exception:  # the directory's cache is being replaced: next round
            log.debug("peer refresh failed", exc_info=True)

    def refresh(self) -> None:
        """Poll the peers the directory names for this model (same digest, or still listing)."""
        infos = [p for p in self.directory(self.key)
                 if p.name != self.me and p.name not in self.dropped and p.digest in (None, self.digest)]
        random.Random(self.me).shuffle(infos)  # each node its own subset when capped, stable over time
        infos.sort(key=lambda p: (p.zone != self.settings.zone or not p.zone, not p.complete))
        infos = infos[: self.settings.max_peers]
        wanted = {p.name: p for p in infos}
        start, stop = [], []
        with self.cond:
            if self._stop.is_set():
                return
            for name, link in list(self.links.items()):
                info = wanted.get(name)
                if info is None or (info.host, info.port, info.fingerprint) != (
                        link.info.host, link.info.port, link.info.fingerprint):
                    self._forget(link)
                    del self.links[name]
                    stop.append(link)
            for name, info in wanted.items():
                if name not in self.links:
                    link = self.links[name] = PeerLink(self, info)
                    start.append(link)
                else:
                    link = self.links[name]
                    if info.digest != link.info.digest:
                        link.wake.set()  # it has listed: poll it now
                    link.info = info
            self.cond.notify_all()
        for link in stop:
            link.stop.set()
            link.wake.set()
        for link in start:
            link.thread.start()

    def apply(self, link: PeerLink, reply: object) -> None:
        from modelcache.peers.protocol import HaveReply

        assert isinstance(reply, HaveReply)
        with self.cond:
            if link.dropped or self.links.get(link.name) is not link:
                return
            if reply.piece_size != self.local.piece_size:
                if not link.incompatible:
                    log.warning("peer %s cuts the model into pieces of %d bytes, we into %d: not used (same "
                                "--chunk-size on every agent)", link.name, reply.piece_size, self.local.piece_size)
                link.incompatible = True
                return
            if reply.full or reply.epoch != link.epoch:
                self._forget(link)
            for ci, piece, hexdigest, _origin in reply.pieces:
                link.have[(ci, piece)] = hexdigest
                self.holders.setdefault((ci, piece), set()).add(link.name)
            link.fetching = set(reply.fetching)
            link.epoch, link.seq, link.complete = reply.epoch, reply.seq, reply.complete
            link.alive, link.answered, link.reachable, link.down_until = True, True, True, 0.0
            self.cond.notify_all()

    def lost(self, link: PeerLink) -> None:
        with self.cond:
            link.alive = False
            link.fetching = set()
            self.cond.notify_all()

    def _forget(self, link: PeerLink) -> None:
        """Caller holds ``cond``."""
        for key in link.have:
            names = self.holders.get(key)
            if names is not None:
                names.discard(link.name)
        link.have, link.fetching = {}, set()

    def drop(self, link: PeerLink, why: str) -> None:
        with self.cond:
            if link.dropped:
                return
            link.dropped = True
            self._forget(link)
            self.dropped.add(link.name)
            self.stats.dropped.append(link.name)
            self.cond.notify_all()
        link.stop.set()
        link.wake.set()
        log.warning("peer dropped for model %s: %s", self.key, why)

    def members(self) -> list[str]:
        """Nodes still downloading the model, among which pieces are owned (caller holds cond)."""
        forming = time.monotonic() < self.formed_at
        out = [self.me]
        for link in self.links.values():
            if link.dropped or link.incompatible or link.info.complete or link.complete:
                continue
            if link.alive or (forming and link.reachable):
                out.append(link.name)
        return out

    def _unheard(self, zone: str | None = None) -> bool:
        """Caller holds ``cond``. While the swarm forms, a peer not yet polled may hold anything:
        no origin read is decided before it answered (or could not be reached); with ``zone``,
        only peers of that zone count."""
        return time.monotonic() < self.formed_at and any(
            not link.answered and link.reachable and not link.dropped and (zone is None or link.info.zone == zone)
            for link in self.links.values())

    def _owner(self, ci: int, piece: int) -> str:
        """Caller holds ``cond``. Who reads the piece from the origin: the member reading it now,
        else the one ranked highest for it."""
        for link in self.links.values():
            if link.alive and not link.dropped and (ci, piece) in link.fetching:
                return link.name
        return max(self.members(), key=lambda n: _rank(n, self.key, ci, piece))

    def owns(self, li: int, piece: int) -> bool:
        """Read this piece from the origin now? (No holder, and ours to read.)"""
        ci = self.local.canon[li]
        now = time.monotonic()
        with self.cond:
            if li in self.force_origin:
                return True
            if any(self.links[n].usable(now) for n in self.holders.get((ci, piece), ()) if n in self.links):
                return False
            return not self._unheard() and self._owner(ci, piece) == self.me

    # ---- origin reads -----------------------------------------------------------------------

    def _take_origin(self) -> bool:
        """Caller holds ``cond``. A group reads the origin with about as many streams as one node
        would (``workers / members`` each): with every member's window of pieces read at once,
        all of them would crawl in together and none be passed on before the end. Few at a
        time, pieces complete early and spread while the next ones load."""
        limit = max(1, -(-self.workers // len(self.members())))
        if self._origin_reads >= limit:
            return False
        self._origin_reads += 1
        return True

    def release_origin(self) -> None:
        with self.cond:
            self._origin_reads -= 1
            self.cond.notify_all()

    def pick(self, li: int, pieces: list[int]) -> int:
        """The engine's next piece of a file, among ``pieces`` (its next pending ones, in order):
        one of ours to read from the origin while an origin read is free (the origin is the
        bottleneck: it must never wait until the engine's order reaches our pieces), else one a
        peer holds, else the first (which may wait for its owner)."""
        ci = self.local.canon[li]
        now = time.monotonic()
        with self.cond:
            if li in self.force_origin or self._unheard():
                return 0
            members = self.members()
            origin_free = self._origin_reads < max(1, -(-self.workers // len(members)))
            held = None
            for i, piece in enumerate(pieces):
                holders = self.holders.get((ci, piece))
                if holders and any(n in self.links and self.links[n].usable(now) for n in holders):
                    if held is None:
                        held = i
                elif origin_free and (li, piece) not in self.local.fetching and self._owner(ci, piece) == self.me:
                    return i
            return held if held is not None else 0

    # ---- getting a piece -------------------------------------------------------------------

    def acquire(self, li: int, piece: int, view: memoryview, stop: threading.Event) -> int:
        """Fill ``view`` with the piece from a peer (verified) and return its length, or return
        -1: read it from the origin, with one of the origin reads taken (``release_origin``)."""
        ci = self.local.canon[li]
        start, end = piece_span(self.local.sizes[li], self.local.piece_size, piece)
        deadline = time.monotonic() + self.settings.wait
        while True:
            if stop.is_set() or self._stop.is_set():
                raise TransientError(f"{self.local.files[li].path}: read aborted")
            now = time.monotonic()
            with self.cond:
                forced = li in self.force_origin
                holders = [self.links[n] for n in self.holders.get((ci, piece), ()) if n in self.links]
                holders = [h for h in holders if h.usable(now) and not forced]
                zone = self.settings.zone
                if zone and holders and all(h.info.zone != zone for h in holders) and self._unheard(zone):
                    holders = []  # a peer of our zone may hold it too: hear it first
                mine = forced or (not holders and not self._unheard() and self._owner(ci, piece) == self.me)
                late = not holders and now >= deadline
                if (mine or late) and self._take_origin():
                    if late and not mine:
                        self.stats.origin_fallbacks += 1
                        log.info("piece %d of %s: no peer delivered it in %.0fs; reading it from the origin",
                                 piece, self.local.files[li].path, self.settings.wait)
                    return -1
            if holders:
                n = self._fetch(holders, li, ci, piece, start, end, view)
                if n >= 0:
                    return n
            with self.cond:
                self.cond.wait(0.2)

    def _fetch(self, holders: list[PeerLink], li: int, ci: int, piece: int, start: int, end: int,
               view: memoryview) -> int:
        zone = self.settings.zone
        holders.sort(key=lambda h: (not zone or h.info.zone != zone, h.inflight, random.random()))
        for link in holders:
            expected = link.have.get((ci, piece))
            if expected is None:
                continue
            with self.cond:
                link.inflight += 1
            try:
                n = self.client.read(link.info, self.key, self.digest, ci, start, end, view)
            except PeerBusy:
                continue
            except PeerGone:
                with self.cond:
                    link.have.pop((ci, piece), None)
                    self.holders.get((ci, piece), set()).discard(link.name)
                link.wake.set()  # it moved on: ask it what it holds now
                continue
            except PeerRefused as exc:
                log.warning("%s", exc)
                link.set_down(30.0)
                continue
            except PeerError as exc:
                log.info("piece %d of %s from %s failed (%s); trying elsewhere", piece,
                         self.local.files[li].path, link.name, exc)
                link.set_down(1.0)
                continue
            finally:
                with self.cond:
                    link.inflight -= 1
            actual = hash_piece(view[:n])
            if actual != expected:
                with self.cond:
                    self.stats.bad_pieces += 1
                self.drop(link, f"piece {piece} of {self.local.files[li].path} has sha-256 {actual}, "
                                f"{link.name} advertised {expected}")
                continue
            self.local.record(li, piece, PieceHash(actual, origin=False))
            with self.cond:
                self.stats.from_peers += n
            return n
        return -1

    def counted_origin(self, n: int) -> None:
        with self.cond:
            self.stats.from_origin += n
