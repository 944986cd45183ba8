"""One model's swarm: the peers that have or fetch it, polled, and pieces read from them.

Membership comes from the directory (the LocalModelNode objects in a cluster): nodes with the
same storage key whose listing digest is ours, or not yet known (they are still listing). Each
is polled (a long poll of its ``have`` endpoint) for the pieces it holds and the pieces it reads
from the origin right now. Where each piece comes from is decided by ``plan.Plan`` (the rules are
there); this module does the I/O: poll threads, piece reads, cancel.

A piece read from a peer has a deadline and can be cancelled (the engine's cancel and stall
watchdog call ``PieceStream.abort``, which cancels the read in flight); its bytes are checked
against the sha-256 the plan expects before one byte reaches the engine. A peer that sends a
piece that does not match is excluded (``on_exclude``: for the agent's lifetime and beyond).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from modelcache.errors import TransientError
from modelcache.peers.client import (
    Cancel,
    PeerBusy,
    PeerCancelled,
    PeerClient,
    PeerError,
    PeerGone,
    PeerInfo,
    PeerRefused,
    PeerSlow,
)
from modelcache.peers.local import LocalPieces
from modelcache.peers.pieces import PieceHash, hash_piece, piece_span
from modelcache.peers.plan import REFUSED_PAUSE, PeerState, Plan, choose_peers
from modelcache.peers.protocol import HaveReply
from modelcache.peers.settings import SwarmSettings
from modelcache.runtime.loop import Loop
from modelcache.sources.integrity import cryptographic

log = logging.getLogger("modelcache.peers")

__all__ = ["PeerLink", "SwarmSession", "SwarmSettings", "SwarmStats"]


@dataclass
class SwarmStats:
    from_origin: int = 0
    from_peers: int = 0
    bad_pieces: int = 0
    origin_fallbacks: int = 0  # pieces read from the origin after waiting in vain for a peer
    dropped: list[str] = field(default_factory=list)


class PeerLink:
    """One peer: its state in the plan, kept current by a polling thread."""

    def __init__(self, session: SwarmSession, info: PeerInfo) -> None:
        self.session, self.info = session, info
        self.state = PeerState(info.name, info.zone, info.complete)
        self.epoch, self.seq = "-", 0
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.cancel = Cancel()  # cuts a poll in flight when the session closes
        self.thread = threading.Thread(target=self._poll_loop, name=f"peer-poll-{info.name}", daemon=True)

    @property
    def name(self) -> str:
        return self.info.name

    def halt(self) -> None:
        self.stop.set()
        self.wake.set()
        self.cancel.cancel()

    def _poll_loop(self) -> None:
        s = self.session
        backoff = 0.5
        while not self.stop.is_set():
            wait = 0.0 if self.epoch == "-" or self.state.complete else s.settings.poll_wait
            try:
                reply = s.client.have(self.info, s.key, s.digest, s.local.geometry, self.epoch, self.seq, wait,
                                      self.cancel)
            except PeerCancelled:
                return
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
                if self.state.complete:  # a seed lists everything once: polled again for liveness,
                    self.wake.wait(30.0)  # or at once after a read from it failed
                    self.wake.clear()
                else:
                    self.stop.wait(s.settings.poll_gap)
                continue
            backoff = min(5.0, backoff * 2)

    def _failed(self, message: str, pause: float, reachable: bool, warn: bool = False) -> None:
        was_alive = self.state.alive
        self.session.lost(self, reachable)
        if message and (warn or was_alive):
            (log.warning if warn else log.info)("peer unreachable: %s", message)
        self.wake.wait(pause)  # a stop, a failed read or a new status cut the pause short
        self.wake.clear()


class SwarmSession:
    """The peers of one model download and the choice of a source for each of its pieces."""

    def __init__(self, settings: SwarmSettings, key: str, digest: str, local: LocalPieces, client: PeerClient,
                 directory: Callable[[str], list[PeerInfo]], excluded: Callable[[str], bool],
                 on_exclude: Callable[[str, str], None], workers: int = 8) -> None:
        self.settings, self.key, self.digest, self.local = settings, key, digest, local
        self.client, self.directory = client, directory
        self.excluded, self.on_exclude = excluded, on_exclude
        self.me = settings.node
        self.stats = SwarmStats()
        self.cond = threading.Condition()
        checked = frozenset(local.canon[li] for li, f in enumerate(local.files)
                            if any(cryptographic(c.algo) for c in f.checksums))
        self.plan = Plan(settings, key, workers, checked=checked, files=len(local.files), counts=local.geometry.counts)
        self.links: dict[str, PeerLink] = {}
        self._peer_bytes: dict[int, int] = {}  # li -> peer bytes the engine took of it
        #: Pieces (ci, piece) streams wait for now in ``acquire``, and how many streams wait for each:
        #: a poll's reply wakes them only if it speaks of one of these, or changes the members.
        self._awaited: dict[tuple[int, int], int] = {}
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
            link.halt()

    # ---- membership ------------------------------------------------------------------------

    def _refresh_quietly(self) -> None:
        try:
            self.refresh()
        except Exception:  # the directory's cache is being replaced: next round
            log.debug("peer refresh failed", exc_info=True)

    def refresh(self) -> None:
        """Poll the peers the directory names for this model (same digest, or still listing)."""
        named = [p for p in self.directory(self.key) if p.name != self.me and not self.excluded(p.name)
                 and p.digest in (None, self.digest)]
        wanted = {p.name: p for p in choose_peers(named, self.settings)}
        start, stop = [], []
        with self.cond:
            if self._stop.is_set():
                return
            version = self.plan.version
            for name, link in list(self.links.items()):
                info = wanted.get(name)
                if info is None or (info.host, info.port, info.fingerprint) != (
                        link.info.host, link.info.port, link.info.fingerprint):
                    self.plan.remove(name)
                    del self.links[name]
                    stop.append(link)
            for name, info in wanted.items():
                if name not in self.links:
                    link = self.links[name] = PeerLink(self, info)
                    self.plan.add(link.state)
                    start.append(link)
                else:
                    link = self.links[name]
                    if info.digest != link.info.digest:
                        link.wake.set()  # it has listed: poll it now
                    link.info = info
                    self.plan.listed(name, info.zone, info.complete)
            # Owners are spread over every node the directory names in our zone, polled or not.
            self.plan.swarm({p.name: (p.zone, p.digest is not None) for p in named if not p.complete})
            if start or stop or self.plan.version != version:  # twice a second: only a change wakes the streams
                self.cond.notify_all()
        for link in stop:
            link.halt()
        for link in start:
            link.thread.start()

    def apply(self, link: PeerLink, reply: HaveReply) -> None:
        with self.cond:
            state = link.state
            if state.excluded or self.links.get(link.name) is not link:
                return
            if reply.piece_size != self.local.piece_size:
                if not state.incompatible:
                    log.warning("peer %s cuts the model into pieces of %d bytes, we into %d: not used (same "
                                "--chunk-size on every agent)", link.name, reply.piece_size, self.local.piece_size)
                state.incompatible = True
                return
            full, version, fetching = reply.full or reply.epoch != link.epoch, self.plan.version, state.fetching
            wrong = self.plan.heard(state, full, reply.pieces, reply.fetching, reply.complete)
            link.epoch, link.seq = reply.epoch, reply.seq
            # Streams waiting in ``acquire`` are woken by a reply that can change their step: the
            # pieces they wait for held or read by someone new, or other members. Any other reply
            # (most of them: 16 agents each hear ~14 a second, and each woke every waiting
            # stream to find nothing new) leaves them to their next look, within 0.2 s.
            if (full or self.plan.version != version
                    or any((ci, piece) in self._awaited for ci, piece, _, _ in reply.pieces)
                    or any(p in self._awaited for p in fetching ^ state.fetching)):
                self.cond.notify_all()
        if wrong is not None:
            self.drop(link, wrong)

    def lost(self, link: PeerLink, reachable: bool) -> None:
        with self.cond:
            self.plan.lost(link.state, reachable)
            self.cond.notify_all()

    def drop(self, link: PeerLink, why: str) -> None:
        """``link`` served a wrong piece: excluded from this download at once, and for good."""
        with self.cond:
            if link.state.excluded:
                return
            self.plan.exclude(link.name)
            self.stats.dropped.append(link.name)
            self.cond.notify_all()
        link.halt()
        log.warning("peer dropped for model %s: %s", self.key, why)
        self.on_exclude(link.name, why)

    def members(self) -> list[str]:
        with self.cond:
            return self.plan.members()

    def owns(self, li: int, piece: int) -> bool:
        """Read this piece from the origin now? (No holder, and ours to read.)"""
        with self.cond:
            return self.plan.owns(self.local.canon[li], piece)

    # ---- origin reads -----------------------------------------------------------------------

    def release_origin(self) -> None:
        with self.cond:
            self.plan.release_origin()
            self.cond.notify_all()

    def pick(self, li: int, pieces: list[int]) -> int:
        """The engine's next piece of a file among ``pieces`` (its next pending ones, in order)."""
        with self.cond:
            fetching = {p for f, p in self.local.fetching if f == li}
            return self.plan.pick(self.local.canon[li], pieces, fetching)

    # ---- getting a piece -------------------------------------------------------------------

    def acquire(self, li: int, piece: int, view: memoryview, stop: threading.Event, cancel: Cancel) -> int:
        """Fill ``view`` with the piece from a peer (verified) and return its length, or return
        -1: read it from the origin, with one of the origin reads taken (``release_origin``).
        Returns within the piece's budget (plus a read begun before it ran out)."""
        ci = self.local.canon[li]
        start, end = piece_span(self.local.sizes[li], self.local.piece_size, piece)
        started = self.plan.clock()  # the plan's clock: what its budgets are measured on
        while True:
            if stop.is_set() or self._stop.is_set():
                raise TransientError(f"{self.local.files[li].path}: read aborted")
            with self.cond:
                step = self.plan.step(ci, piece, started)
                if step.missed is not None and not step.late:
                    log.info("piece %d of %s: %s did not read it in %.0fs; its pieces go to other nodes",
                             piece, self.local.files[li].path, step.missed, self.plan.clock() - started)
                if step.origin and self.plan.take_origin(force=step.late):
                    if step.late:
                        self.stats.origin_fallbacks += 1
                        if step.missed is not None:
                            self.plan.missed(step.missed)
                        log.info("piece %d of %s: no peer delivered it in %.0fs (%s); reading it from the origin",
                                 piece, self.local.files[li].path, self.plan.clock() - started,
                                 "held, every holder busy" if step.held else "held by no peer we may ask")
                    return -1
                holders = [self.links[n] for n in step.holders if n in self.links]
            for link in holders:
                n = self._fetch(link, li, ci, piece, start, end, view, started, cancel)
                if n >= 0:
                    return n
                if stop.is_set():
                    break
            with self.cond:
                self._awaited[(ci, piece)] = self._awaited.get((ci, piece), 0) + 1
                try:
                    self.cond.wait(0.2)
                finally:
                    left = self._awaited.pop((ci, piece)) - 1
                    if left:
                        self._awaited[(ci, piece)] = left

    def _fetch(self, link: PeerLink, li: int, ci: int, piece: int, start: int, end: int, view: memoryview,
               started: float, cancel: Cancel) -> int:
        with self.cond:
            expected = self.plan.expected(link.name, ci, piece)
            if expected is None:
                return -1
            link.state.inflight += 1
        path = self.local.files[li].path
        try:
            # The socket's deadline is monotonic time; the plan's clock is that too but in a simulator.
            now = time.monotonic()
            deadline = now + self.settings.read_deadline(self.plan.clock(), started, end - start) - self.plan.clock()
            n = self.client.read(link.info, self.key, self.digest, ci, start, end, view, deadline, cancel)
        except PeerCancelled:
            raise TransientError(f"{path}: read aborted") from None
        except PeerBusy as exc:
            with self.cond:
                self.plan.busy(link.name, exc.retry_after)
            return -1
        except PeerGone:
            with self.cond:
                self.plan.gone(link.name, ci, piece)
            link.wake.set()  # it moved on: ask it what it holds now
            return -1
        except PeerRefused as exc:
            log.warning("%s", exc)
            with self.cond:
                self.plan.failed(link.name, REFUSED_PAUSE)
            return -1
        except PeerSlow as exc:
            log.info("piece %d of %s from %s too slow (%s); trying elsewhere", piece, path, link.name, exc)
            with self.cond:
                self.plan.slow(link.name)
            return -1
        except PeerError as exc:
            log.info("piece %d of %s from %s failed (%s); trying elsewhere", piece, path, link.name, exc)
            with self.cond:
                self.plan.failed(link.name)
            link.wake.set()
            return -1
        finally:
            with self.cond:
                link.state.inflight -= 1
        actual = hash_piece(view[:n])
        if actual != expected:
            with self.cond:
                self.stats.bad_pieces += 1
            self.drop(link, f"piece {piece} of {path} has sha-256 {actual}, {link.name} advertised {expected}")
            return -1
        self.local.record(li, piece, PieceHash(actual, origin=False))
        with self.cond:
            self.plan.delivered(link.name)
            self.plan.took(link.name, ci, piece, actual)
        return n

    def settled(self, li: int, piece: int, value: str) -> None:
        """We read the piece from the origin (sha-256 ``value``): every peer that said, or sent,
        otherwise is excluded for good."""
        ci = self.local.canon[li]
        with self.cond:
            wrong = self.plan.settle(ci, piece, value)
            # A witness excluded already (for another piece, or by another download) is not again.
            wrong = {name: said for name, said in wrong.items()
                     if not (name in self.plan.peers and self.plan.peers[name].excluded)}
            links = {name: self.links.get(name) for name in wrong}
        path = self.local.files[li].path
        for name, said in wrong.items():
            why = f"piece {piece} of {path} has sha-256 {value} at the origin, {name} said {said}"
            link = links[name]
            if link is not None:
                self.drop(link, why)
            elif not self.excluded(name):
                log.warning("peer dropped for model %s: %s", self.key, why)
                self.on_exclude(name, why)

    def counted_origin(self, n: int) -> None:
        with self.cond:
            self.stats.from_origin += n

    def counted_peer(self, li: int, n: int) -> None:
        """Verified peer bytes the engine took (a piece read, then dropped by a stall, is not)."""
        with self.cond:
            self.stats.from_peers += n
            self._peer_bytes[li] = self._peer_bytes.get(li, 0) + n

    def file_reset(self, li: int) -> None:
        """The file is fetched again, from the origin only: its peer bytes were of no use."""
        with self.cond:
            self.plan.reset(self.local.canon[li])
            self.stats.from_peers -= self._peer_bytes.pop(li, 0)

    def distrusted(self, li: int) -> str | None:
        with self.cond:
            return self.plan.distrusted(self.local.canon[li], self.excluded)
