"""Where each piece of a model comes from: the swarm's decisions, apart from sockets and threads.

``SwarmSession`` (swarm.py) polls the peers and reads pieces; this module decides, from what the
peers said, whom to ask for a piece, who reads it from the origin, how long to wait, and which
peer no longer deserves a request. It does no I/O and reads the time only through ``clock``,
so the same code can be driven by a simulated clock (a swarm simulator) or tested alone.

The rules (docs/peers.md, "How a download uses peers" and "Trust nothing from a peer"):

1. **A peer that holds the piece**, in our zone first, then the one with the fewest of our
   requests in flight. A holder that answers "busy" (503) is skipped until its ``Retry-After``;
   one still busy when the piece's wait runs out is left alone for ``STARVING_PAUSE``. A read
   that misses its deadline (a slow or trickling peer) costs that peer a strike and a pause; two
   strikes and it is not asked again during this download.
2. **Else the origin, if we own the piece**: owners are spread by a consistent-hash ring
   (``ring.py``) of the model's blocks over the members still downloading; a member reading the
   piece right now owns it.
3. **Else wait for the owner**, but never longer than the piece's budget: ``wait`` seconds and
   at most half the stall timeout, so that the engine's stall watchdog never fires on a piece
   that waits for peers. A piece held by a peer that served us before and is only busy (every
   upload slot taken; neither slow nor failed) waits to the stall bound instead: it is in the
   group, and a slot frees when an upload ends. A piece past its wait is read from the origin
   whoever holds or owns it (even beyond the group's share of origin streams), and an owner we
   waited for in vain (half the budget if it reads nothing from the origin) no longer counts as
   a member nor as the reader of the pieces it claims, for this download.
4. **While the swarm forms** (``formation`` seconds) a member still listing counts as an owner
   and a peer not yet heard may hold anything: nobody starts the origin on pieces they would own.

Whose word a piece's bytes are checked against (``expected``): a peer's *vouch* for a piece is
the sha-256 it lists for it, and whether it read the piece from the origin itself (a *witness*).
Every vouch is heard from that node directly, over TLS pinned to the certificate its own
LocalModelNode status names (which only that node may write): nobody speaks for another node.

- Witnesses that disagree: no peer serves the piece; the origin decides (``settle``).
- A file whose source checksum is unforgeable (``checked``): the piece must match the witness,
  or, with none yet, the holder's own vouch; the file checksum has the last word, and a file
  that fails it is read again from the origin and each piece compared (``settle``).
- Any other file: ``witnesses`` nodes must have read the piece from the origin and agree, and
  the holder's vouch must be theirs. The pieces are owned by that many members each, so a group
  reads such files ``witnesses`` times from the origin, and one lying node cannot make another
  accept a byte it alone vouches for.
- Every piece we read from the origin ourselves is compared with every vouch heard for it
  (``settle``): a witness whose vouch differs is excluded for good, and so is a peer whose bytes
  do not match its own vouch. A peer that only passes a piece on (its vouch is no witness's) and
  whose hash, or whose bytes we took, differ is excluded only if no witness vouched for that hash:
  if one did, the witness lied and the relay was deceived as we were (an honest node that passed
  on a liar's piece before its own file check failed is not to be excluded by everyone it served).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

from modelcache.peers.ring import Ring, h64
from modelcache.peers.settings import SwarmSettings

#: Hashes a node may claim, as a witness, for one piece (plan.claims): the truth and a lie.
MAX_CLAIMS = 2
#: Read-from-a-peer strikes (deadline missed) after which a peer is not asked again this download.
SLOW_STRIKES = 2
#: Seconds a peer is left alone after a slow read, a refused credential, a piece that went past
#: its budget while the peer answered "busy", and after a failed read.
SLOW_PAUSE, REFUSED_PAUSE, STARVING_PAUSE, FAILED_PAUSE = 30.0, 30.0, 30.0, 1.0


@dataclass
class Health:
    """How one peer behaved during this download (nothing here outlives it)."""

    down_until: float = 0.0  # failed, slow, refused our credential, or busy for too long
    busy_until: float = 0.0  # its Retry-After
    busy_streak: int = 0
    fail_streak: int = 0  # failed reads in a row (each pauses it twice as long as the last)
    slow_strikes: int = 0
    #: We waited for it to read a piece from the origin, in vain: its claims and its ownership
    #: no longer count (a member claiming every piece would otherwise cost a wait per piece).
    missed: bool = False
    last_piece: float = float("-inf")

    def usable(self, now: float) -> bool:
        return self.dependable(now) and now >= self.busy_until

    def dependable(self, now: float) -> bool:
        """Worth waiting for: not down, and not too slow (a busy peer frees a slot soon)."""
        return now >= self.down_until and self.slow_strikes < SLOW_STRIKES


class Vouch(NamedTuple):
    """A peer's word about a piece: its sha-256, and whether the peer read it from the origin.
    (A tuple: one is made for every piece of every poll's reply, and a frozen dataclass costs
    several times as much to make; bench/swarm_sim.py at 100 nodes makes 800,000.)"""

    hash: str
    origin: bool


@dataclass
class PeerState:
    """What one peer told us about the model, and how it behaved."""

    name: str
    zone: str = ""
    #: Its directory entry says it holds the whole model (Downloaded).
    listed_complete: bool = False
    have: dict[tuple[int, int], Vouch] = field(default_factory=dict)
    fetching: set[tuple[int, int]] = field(default_factory=set)
    alive: bool = False  # its last poll succeeded
    answered: bool = False  # it answered a poll, even "not held" (a 404: it is still listing)
    reachable: bool = True  # its last poll did not fail to connect, time out or break
    complete: bool = False  # it said it holds every piece
    excluded: bool = False  # it lied or served wrong bytes: never asked again
    incompatible: bool = False  # another piece size
    inflight: int = 0
    health: Health = field(default_factory=Health)

    def usable(self, now: float) -> bool:
        return self.alive and not self.excluded and not self.incompatible and self.health.usable(now)


@dataclass(frozen=True)
class Step:
    """What to do next for a piece: read it from the origin, ask ``holders`` (in order), or wait."""

    origin: bool = False
    #: Past its budget: read from the origin even beyond the group's share of origin streams.
    late: bool = False
    holders: tuple[str, ...] = ()
    #: The owner we waited for in vain (late, nobody held it): it is marked ``missed``.
    missed: str | None = None
    #: Late although peers held it (every holder busy until the stall bound).
    held: bool = False


class Candidate(Protocol):
    """A peer as the directory names it (``client.PeerInfo``)."""

    @property
    def name(self) -> str: ...
    @property
    def zone(self) -> str: ...
    @property
    def complete(self) -> bool: ...


C = TypeVar("C", bound=Candidate)


def choose_peers(candidates: list[C], settings: SwarmSettings) -> list[C]:
    """The peers to poll for a model, of those the directory names: our zone first, at most
    ``max_peers``; each node its own random subset when capped (shuffled by our name: the same
    subset from one refresh to the next). Not seeds first: the first nodes done would be polled
    by every node of the zone (a poll holds a connection and a server thread), where a random
    choice has each node polled by about ``max_peers`` others whatever the group's size
    (bench/swarm_sim.py: at most 23 of 39 at 40 nodes, N at 1,000)."""
    out = list(candidates)
    random.Random(settings.node).shuffle(out)
    out.sort(key=lambda p: p.zone != settings.zone or not p.zone)
    return out[: settings.max_peers]


class Plan:
    """One model's swarm as data: the peers, who holds what, and the decisions. Not thread-safe:
    the session calls it under its lock. Files are numbered in path order (``ci``) throughout."""

    def __init__(self, settings: SwarmSettings, key: str, workers: int = 8,
                 clock: Callable[[], float] = time.monotonic, seed: str | None = None,
                 checked: frozenset[int] = frozenset(), files: int = 0, counts: tuple[int, ...] = ()) -> None:
        self.settings, self.key = settings, key
        self.files = files
        #: Pieces of each file (ci): blocks are cut by it (no blocks when unknown).
        self.counts = counts
        #: Files (ci) whose source checksum no one can forge: the file check settles them.
        self.checked = checked
        #: Pieces whose bytes we took from a peer: (ci, piece) -> (peer, sha-256).
        self.taken: dict[tuple[int, int], tuple[str, str]] = {}
        #: Every witness vouch heard: (ci, piece) -> sha-256 -> who said it read that from the origin
        #: (kept when a peer's word is forgotten: a relay of a lie is blamed on who told it).
        self.claims: dict[tuple[int, int], dict[str, set[str]]] = {}
        #: Pieces taken from peers: (ci, piece) -> the nodes whose word they were taken on.
        self.relied: dict[tuple[int, int], frozenset[str]] = {}
        #: Pieces we read from the origin ourselves: (ci, piece) -> sha-256 (the truth).
        self.read_from_origin: dict[tuple[int, int], str] = {}
        self.me = settings.node
        self.workers = max(1, workers)
        self.clock = clock
        self.rng = random.Random(seed if seed is not None else self.me)
        self.formed_at = clock() + settings.formation
        self.peers: dict[str, PeerState] = {}
        #: Every node the directory names for the model (polled or not): name -> (zone, listed).
        self.swarm_nodes: dict[str, tuple[str, bool]] = {}
        #: Nodes whose pieces we waited for in vain (polled or not): they own nothing any more.
        self.missed_nodes: set[str] = set()
        self._version = 0  # bumped by whatever changes who the members are
        self._members: tuple[tuple[int, bool], list[str]] | None = None
        self._ring: Ring | None = None
        self._block_points: dict[tuple[int, int], int] = {}
        #: The ring's owners of a block, by (block, how many): valid while ``_ring`` is.
        self._ring_owners: dict[tuple[tuple[int, int], int], list[str]] = {}
        self._block_sizes: dict[int, int] = {}
        #: Pieces we wait for: (ci, piece) -> (the owner we wait for, since when).
        self._waiting: dict[tuple[int, int], tuple[str, float]] = {}
        #: Since when a polled peer has been seen reading a piece from the origin: (peer, ci, piece) -> when.
        self._reading_since: dict[tuple[str, int, int], float] = {}
        self.holders: dict[tuple[int, int], set[str]] = {}
        #: Pieces polled peers read from the origin right now: (ci, piece) -> who.
        self.fetchers: dict[tuple[int, int], set[str]] = {}
        self.origin_reads = 0
        #: Files (ci) read from the origin only (fetched again after a checksum mismatch).
        self.force_origin: set[int] = set()

    @property
    def version(self) -> int:
        """Bumped by whatever changes who the members are (or what the directory says of a peer)."""
        return self._version

    # ---- what the peers say -------------------------------------------------------------------

    def add(self, state: PeerState) -> None:
        self.peers[state.name] = state
        self._version += 1

    def remove(self, name: str) -> None:
        state = self.peers.pop(name, None)
        if state is not None:
            self.forget(state)
        self._version += 1

    def listed(self, name: str, zone: str, complete: bool) -> None:
        """What the directory says now of a polled peer (its zone, whether it holds it all)."""
        state = self.peers.get(name)
        if state is not None and (state.zone, state.listed_complete) != (zone, complete):
            state.zone, state.listed_complete = zone, complete
            self._version += 1

    def swarm(self, nodes: dict[str, tuple[str, bool]]) -> None:
        """Every node the directory names for the model, polled or not, except those that hold
        it all: name -> (zone, listed: it published our listing digest). Pieces are owned among
        those of our zone (``members``), so that nodes polling different peers agree on owners."""
        if nodes != self.swarm_nodes:
            self.swarm_nodes = dict(nodes)
            self._version += 1

    def reset(self, ci: int) -> None:
        """File ``ci`` is fetched again from the origin: what we took of it no longer counts."""
        self.force_origin.add(ci)
        for piece in [k for k in self.relied if k[0] == ci]:
            del self.relied[piece]

    def forget(self, state: PeerState) -> None:
        """Everything ``state`` said it holds or fetches is void (a new epoch, an exclusion)."""
        for piece in state.have:
            names = self.holders.get(piece)
            if names is not None:
                names.discard(state.name)
        state.have = {}
        self._fetching(state, set())

    def heard(self, state: PeerState, full: bool, pieces: list[tuple[int, int, str, bool]],
              fetching: list[tuple[int, int]], complete: bool) -> str | None:
        """A poll's answer: everything (``full``) or what was added since the last one. Returns
        why the peer must be excluded, if it vouches otherwise for a piece we read from the
        origin ourselves."""
        if full:
            self.forget(state)
        wrong = None
        for ci, piece, hexdigest, origin in pieces:
            if origin:
                self.claim(state.name, ci, piece, hexdigest)
            ours = self.read_from_origin.get((ci, piece))
            if (ours is not None and ours != hexdigest and wrong is None
                    and not self.relayed(state.name, ci, piece, hexdigest, origin)):
                wrong = f"piece {piece} of file {ci} has sha-256 {ours} at the origin, {state.name} said {hexdigest}"
            state.have[(ci, piece)] = Vouch(hexdigest, origin)
            self.holders.setdefault((ci, piece), set()).add(state.name)
        self._fetching(state, set(fetching))
        if (state.complete, state.alive, state.answered, state.reachable) != (complete, True, True, True):
            self._version += 1
        state.complete = complete
        state.alive = state.answered = state.reachable = True
        return wrong

    def _fetching(self, state: PeerState, now: set[tuple[int, int]]) -> None:
        """``state`` reads ``now`` from the origin (the ``fetchers`` index follows)."""
        for piece in state.fetching - now:
            self._reading_since.pop((state.name, *piece), None)
            names = self.fetchers.get(piece)
            if names is not None:
                names.discard(state.name)
                if not names:
                    del self.fetchers[piece]
        new = now - state.fetching
        when = self.clock() if new else 0.0
        for piece in new:
            self.fetchers.setdefault(piece, set()).add(state.name)
            self._reading_since[(state.name, *piece)] = when
        state.fetching = now

    def lost(self, state: PeerState, reachable: bool) -> None:
        """A poll failed: it stops counting as a member (its pieces get other owners)."""
        state.alive = False
        self._fetching(state, set())
        state.answered = state.answered or reachable
        state.reachable = reachable
        self._version += 1

    def exclude(self, name: str) -> None:
        state = self.peers.get(name)
        if state is not None and not state.excluded:
            state.excluded = True
            self.forget(state)
            self._version += 1

    # ---- how they behave -------------------------------------------------------------------------

    def delivered(self, name: str) -> None:
        state = self.peers.get(name)
        if state is not None:
            state.health.busy_streak = state.health.fail_streak = 0
            state.health.last_piece = self.clock()

    def busy(self, name: str, retry_after: float) -> None:
        state = self.peers.get(name)
        if state is not None:
            state.health.busy_streak += 1
            state.health.busy_until = max(state.health.busy_until, self.clock() + retry_after)

    def slow(self, name: str) -> None:
        state = self.peers.get(name)
        if state is not None:
            state.health.slow_strikes += 1
            state.health.down_until = max(state.health.down_until, self.clock() + SLOW_PAUSE)

    def failed(self, name: str, pause: float = FAILED_PAUSE) -> None:
        """A read failed (a reset, a malformed reply): paused 1, 2, 4 ... up to 30 s in a row."""
        state = self.peers.get(name)
        if state is not None:
            h = state.health
            state.alive = False
            self._version += 1
            pause = min(SLOW_PAUSE, max(pause, FAILED_PAUSE * 2 ** h.fail_streak))
            h.fail_streak += 1
            h.down_until = max(h.down_until, self.clock() + pause)

    def gone(self, name: str, ci: int, piece: int) -> None:
        """It does not hold the piece (any more)."""
        state = self.peers.get(name)
        if state is not None:
            state.have.pop((ci, piece), None)
        self.holders.get((ci, piece), set()).discard(name)

    # ---- membership and ownership -------------------------------------------------------------------

    def members(self) -> list[str]:
        """Nodes of our zone still downloading the model, among which pieces are owned: every
        node the directory names in our zone (it lists the model, or still lists it while the
        swarm forms), and the polled peers of our zone; less those we know hold it all, failed
        to reach, excluded, or waited for in vain. Memoized until one of those changes."""
        forming = self.clock() < self.formed_at
        key = (self._version, forming)
        if self._members is not None and self._members[0] == key:
            return self._members[1]
        zone = self.settings.zone
        out = [self.me]
        seen = {self.me}
        for name, (their_zone, listed) in self.swarm_nodes.items():
            if name in seen or their_zone != zone or name in self.missed_nodes:
                continue
            seen.add(name)
            p = self.peers.get(name)
            if p is None:
                if listed or forming:
                    out.append(name)
                continue
            if self._member(p, forming):
                out.append(name)
        for p in self.peers.values():
            if p.name not in seen and p.zone == zone and p.name not in self.missed_nodes and self._member(p, forming):
                out.append(p.name)
        self._members = (key, out)
        self._ring = None
        return out

    @staticmethod
    def _member(p: PeerState, forming: bool) -> bool:
        if p.excluded or p.incompatible or p.listed_complete or p.complete or p.health.missed:
            return False
        return p.alive or (forming and p.reachable)

    def unheard(self, zone: str | None = None) -> bool:
        """While the swarm forms, a peer not yet polled may hold anything: no origin read is
        decided before it answered (or could not be reached); with ``zone``, only that zone's."""
        return self.clock() < self.formed_at and any(
            not p.answered and p.reachable and not p.excluded and (zone is None or p.zone == zone)
            for p in self.peers.values())

    def owners(self, ci: int, piece: int) -> list[str]:
        """Who reads the piece from the origin: one node for a checked file, ``witnesses`` for any
        other, less those that read it already; members reading it now first, then the piece's
        block's owners on the ring of our zone's members. Witnesses that disagree: every member
        reads it (the origin decides)."""
        key = (ci, piece)
        if key not in self.holders and key not in self.fetchers:
            # Nobody holds it or reads it: its block's owners on the ring (pick asks this of
            # every piece of its window, on every take).
            return list(self._block_owners(ci, piece, 1 if ci in self.checked else max(1, self.settings.witnesses)))
        witnessed = self.witnessed(ci, piece)
        if len(witnessed) > 1:
            return self.members()
        # Witnesses we can read it from (a busy one soon): a slow or failed one is not waited for.
        done: set[str] = set()
        if witnessed:
            now = self.clock()
            done = {n for n in next(iter(witnessed.values())) if self.peers[n].alive
                    and self.peers[n].health.dependable(now)}
        need = (1 if ci in self.checked else max(1, self.settings.witnesses)) - len(done)
        if need <= 0:
            return []
        zone = self.settings.zone
        out: list[str] = []
        for name in sorted(self.fetchers.get((ci, piece), ())):
            p = self.peers.get(name)
            if (p is not None and name not in done and p.alive and not p.excluded and not p.health.missed
                    and p.zone == zone and len(out) < need):
                out.append(name)
        if len(out) < need:
            skip = {*out, *done}
            if skip:
                ring = self._current_ring()
                block = (ci, piece // self.block_of(ci))
                out += ring.owners(self._block_point(block), need - len(out), skip=skip)
            else:
                out += self._block_owners(ci, piece, need)
        return out

    def _current_ring(self) -> Ring:
        members = self.members()  # a new member set drops the ring
        if self._ring is None:
            self._ring = Ring(frozenset(members))
            self._ring_owners = {}
        return self._ring

    def _block_owners(self, ci: int, piece: int, need: int) -> list[str]:
        """The first ``need`` owners of the piece's block on the ring of our zone's members,
        memoized per ring (bench/swarm_sim.py at 100 nodes: 1.7 million ring walks for 3,300 blocks)."""
        ring, block = self._current_ring(), (ci, piece // self.block_of(ci))
        found = self._ring_owners.get((block, need))
        if found is None:
            found = self._ring_owners[(block, need)] = ring.owners(self._block_point(block), need)
        return found

    def _block_point(self, block: tuple[int, int]) -> int:
        if block not in self._block_points:
            self._block_points[block] = h64(f"{self.key}\0{block[0]}\0{block[1]}")
        return self._block_points[block]

    def block_of(self, ci: int) -> int:
        """Pieces per block of file ``ci``: the same for every node (the file's size decides)."""
        size = self._block_sizes.get(ci)
        if size is None:
            count = self.counts[ci] if ci < len(self.counts) else 0
            size = self._block_sizes[ci] = max(1, min(self.settings.block, count // 8))
        return size

    def usable_holders(self, ci: int, piece: int) -> list[PeerState]:
        """Peers to ask for the piece, best first: our zone, then the fewest of our requests."""
        now = self.clock()
        if ci not in self.checked and self.unheard():
            return []  # whose word counts is decided once every peer had its say (or the swarm formed)
        found = [self.peers[n] for n in self.holders.get((ci, piece), ()) if n in self.peers]
        found = [p for p in found if p.usable(now) and self.expected(p.name, ci, piece) is not None]
        zone = self.settings.zone
        found.sort(key=lambda p: (not zone or p.zone != zone, p.inflight, self.rng.random()))
        return found

    def held(self, ci: int, piece: int, busy: bool = False) -> bool:
        """Whether a peer we may ask holds the piece (``usable_holders``, without the order); with
        ``busy``: one that has served us before, busy now or not (a slot frees when one of its
        uploads ends; one that never served us may be busy for ever), neither slow nor failed."""
        names = self.holders.get((ci, piece))
        if not names or (ci not in self.checked and self.unheard()):
            return False
        now = self.clock()
        for name in names:
            p = self.peers.get(name)
            if p is None or self.expected(name, ci, piece) is None:
                continue
            if (p.alive and not p.excluded and p.health.dependable(now) and p.health.last_piece > float("-inf")
                    if busy else p.usable(now)):
                return True
        return False

    def owns(self, ci: int, piece: int) -> bool:
        """Read this piece from the origin now? (No holder, and ours to read.)"""
        if ci in self.force_origin:
            return True
        if self.held(ci, piece):
            return False
        return not self.unheard() and self.me in self.owners(ci, piece)

    # ---- origin reads ---------------------------------------------------------------------------

    def origin_limit(self) -> int:
        """A group reads the origin with about as many streams as one node would (``workers /
        members`` each, times the witnesses each piece needs when a file has no checksum that
        settles it): with every member's window read at once, all of it would crawl in together
        and none be passed on before the end."""
        reads = 1 if len(self.checked) == self.files else max(1, self.settings.witnesses)
        return max(1, -(-self.workers * reads // len(self.members())))

    def take_origin(self, force: bool = False) -> bool:
        if not force and self.origin_reads >= self.origin_limit():
            return False
        self.origin_reads += 1
        return True

    def release_origin(self) -> None:
        self.origin_reads -= 1

    # ---- the decisions -------------------------------------------------------------------------------

    def pick(self, ci: int, pieces: list[int], fetching: set[int]) -> int:
        """The engine's next piece of a file, among ``pieces`` (its next pending ones, in order;
        ``fetching``: those we read from the origin already): one of ours to read from the
        origin while an origin read is free (the origin is the bottleneck: it must never wait
        until the engine's order reaches our pieces), else one a peer holds, else the first
        (which may wait for its owner)."""
        if ci in self.force_origin or self.unheard():
            return 0
        origin_free = self.origin_reads < self.origin_limit()
        held = None
        for i, piece in enumerate(pieces):
            if self.held(ci, piece):
                if held is None:
                    held = i
                    if not origin_free:
                        break  # nothing after it can be picked instead
            elif origin_free and piece not in fetching and self.me in self.owners(ci, piece):
                return i
        return held if held is not None else 0

    def step(self, ci: int, piece: int, started: float) -> Step:
        """The next step for a piece first asked for at ``started`` (see the module's rules)."""
        forced = ci in self.force_origin
        holders = [] if forced else self.usable_holders(ci, piece)
        zone = self.settings.zone
        if zone and holders and all(h.zone != zone for h in holders) and self.unheard(zone):
            holders = []  # a peer of our zone may hold it too: hear it first
        owners = self.owners(ci, piece) if not forced else [self.me]
        now = self.clock()
        missed = None
        until = started + self.settings.budget
        if not holders and not forced and owners and self.me not in owners:
            # Half the budget waited for an owner and nobody holds the piece: an owner reading
            # nothing from the origin is waited for no longer (it owns nothing more, for this
            # download) and its blocks go to the next member on the ring, the same one for everyone
            # who waited. One reading other pieces works through its share one read at a time: on
            # starved cores a second reader doubled its last pieces at the origin (bench/swarm_sim.py,
            # 16 agents on 2 loaded cores: 1.58x the model; 1.11x waiting the whole budget for it).
            since = self._waiting.setdefault((ci, piece), (owners[0], max(started, now)))
            if since[0] != owners[0]:
                since = self._waiting[(ci, piece)] = (owners[0], now)
            owner = owners[0]
            seen = self._reading_since.get((owner, ci, piece))
            if now >= since[1] + self.settings.budget / 2 and (
                    owner not in self.peers or not self.peers[owner].fetching):
                missed = owner
                self.missed(owner)
                owners = self.owners(ci, piece)
            elif seen is not None:
                # Seen reading this very piece: a whole budget from then, within the stall bound
                # (bench/fleet.py, 16 agents at load 60: 245 pieces read twice after 15 s while
                # their owner read them at 1 MiB/s a stream). A liar "reading" everything costs
                # this once: its claims count no more after (``missed``).
                until = min(max(until, seen + self.settings.budget), self.settings.stall_bound(started))
        mine = forced or (not holders and not self.unheard() and self.me in owners)
        if mine:
            return Step(origin=True, missed=missed)
        held = now >= until and not forced and self.held(ci, piece, busy=True)
        if held:
            # Held in the group by a peer neither slow nor failed, only busy serving others: wait
            # to the stall bound rather than read the origin the owners share (bench/swarm_sim.py
            # in bench/fleet.py's recorded 16-node world: 41 of the 42 pieces that went past their
            # budget were held, each by 1-13 peers that all answered "busy").
            until = self.settings.stall_bound(started)
        if now >= until:
            # Holders busy all along (a seed whose slots others hold, or one that says "busy" to
            # everyone for ever) are left alone for a while: the next pieces do not wait for them.
            for name in self.holders.get((ci, piece), ()):
                h = self.peers[name].health if name in self.peers else None
                if h is not None and h.busy_streak:
                    h.busy_streak, h.down_until = 0, max(h.down_until, now + STARVING_PAUSE)
            vouched = {n for names in self.witnessed(ci, piece).values() for n in names}
            waited = [n for n in owners if n != self.me and n not in vouched]
            return Step(origin=True, late=True, missed=waited[0] if not holders and waited else None, held=held)
        return Step(holders=tuple(h.name for h in holders), missed=missed)

    def missed(self, name: str) -> None:
        state = self.peers.get(name)
        if state is not None:
            state.health.missed = True
        self.missed_nodes.add(name)
        self._version += 1

    def expected(self, holder: str, ci: int, piece: int) -> str | None:
        """The sha-256 the piece must have when ``holder`` serves it; None: do not ask it (see
        the module's rules)."""
        state = self.peers.get(holder)
        vouch = state.have.get((ci, piece)) if state is not None else None
        if vouch is None:
            return None
        witnessed = self.witnessed(ci, piece)
        if len(witnessed) > 1:
            return None  # witnesses disagree: the origin decides
        if witnessed:
            (value, names), = witnessed.items()
            if vouch.hash != value:
                return None
            if ci in self.checked or len(names) >= max(1, self.settings.witnesses):
                return value
            return None
        return vouch.hash if ci in self.checked else None

    def witnessed(self, ci: int, piece: int) -> dict[str, set[str]]:
        """The piece's sha-256 as the peers that read it from the origin say: hash -> who."""
        out: dict[str, set[str]] = {}
        for name in self.holders.get((ci, piece), ()):
            state = self.peers.get(name)
            vouch = state.have.get((ci, piece)) if state is not None and not state.excluded else None
            if vouch is not None and vouch.origin:
                out.setdefault(vouch.hash, set()).add(name)
        return out

    def took(self, name: str, ci: int, piece: int, value: str) -> None:
        """We took the piece's bytes from ``name``: on its word and that of the witnesses."""
        self._waiting.pop((ci, piece), None)
        self.taken[(ci, piece)] = (name, value)
        self.relied[(ci, piece)] = frozenset({name, *self.witnessed(ci, piece).get(value, ())})

    def distrusted(self, ci: int, excluded: Callable[[str], bool]) -> str | None:
        """Why file ``ci``'s bytes must be fetched again: a piece of it was taken on the word of
        a node excluded since (None: none was)."""
        for (f, piece), names in self.relied.items():
            if f == ci:
                liars = sorted(n for n in names if excluded(n) or (n in self.peers and self.peers[n].excluded))
                if liars:
                    return f"piece {piece} came on the word of {', '.join(liars)}, found lying since"
        return None

    def claim(self, name: str, ci: int, piece: int, value: str) -> None:
        """``name`` says it read the piece from the origin and it has sha-256 ``value``. Two hashes
        per node and piece are kept at most (the origin's bytes have one: a second is a lie, which
        is all settle needs): a peer cannot grow this by changing its word at every poll."""
        said = self.claims.setdefault((ci, piece), {})
        if name not in said.get(value, ()) and sum(name in names for names in said.values()) < MAX_CLAIMS:
            said.setdefault(value, set()).add(name)

    def relayed(self, name: str, ci: int, piece: int, value: str, origin: bool) -> bool:
        """Whether ``name`` only passed on ``value`` for the piece: it is no witness of it, and
        another node vouched for it as one (if that is a lie, that witness told it)."""
        return not origin and any(n != name for n in self.claims.get((ci, piece), {}).get(value, ()))

    def settle(self, ci: int, piece: int, value: str) -> dict[str, str]:
        """We read the piece from the origin: its sha-256 is ``value``. Returns the peers whose
        word or bytes said otherwise (peer -> what it said), to be excluded: every witness of
        another hash, and a relay of one only when no witness vouched for it (module docstring)."""
        key = (ci, piece)
        self._waiting.pop(key, None)
        self.read_from_origin[key] = value
        wrong: dict[str, str] = {}
        for said, names in self.claims.get(key, {}).items():
            if said != value:
                wrong.update(dict.fromkeys(names, said))
        for name in self.holders.get(key, ()):
            state = self.peers.get(name)
            vouch = state.have.get(key) if state is not None else None
            if vouch is not None and vouch.hash != value and not self.relayed(name, ci, piece, vouch.hash,
                                                                             vouch.origin):
                wrong[name] = vouch.hash
        self.relied.pop(key, None)
        took = self.taken.pop(key, None)
        if took is not None and took[1] != value:
            name, said = took
            if not self.relayed(name, ci, piece, said, name in self.claims.get(key, {}).get(said, ())):
                wrong[name] = said
        return wrong
