"""A swarm of agents filling one model, simulated: the peers' own decision code on simulated links
and a virtual clock.

Every decision is made by the code the agents run (``modelcache.peers.plan``): which peers a node
polls (``choose_peers``: its zone first, at most ``max_peers``), who owns a piece and reads it from
the origin, which holder to ask (zone first, fewest requests in flight), how long to wait for an
owner (the piece's budget: ``--peer-wait`` and half the stall timeout), the formation window, the
origin-read share, and the engine's order of pieces (``Plan.pick``). What this file adds is the
world around it, as the real code meets it:

- **the engine**: ``--workers`` streams per node, each takes the file with the fewest streams and,
  in a window of its next 64 pending pieces, the piece ``pick`` names; a piece from the origin is
  read and hashed as it passes, one from a peer is read whole (transfer/PieceStream, swarm.py);
- **the peer protocol**: each polled peer is long-polled (a reply as soon as it has a new piece or
  reads another from the origin, else after ``poll_wait``; the next poll ``poll_gap`` later); a
  peer's upload slots (``--peer-max-uploads``, one request waits ``SLOT_WAIT`` for a slot, then
  "busy" with Retry-After 1 s); a peer read's deadline (``read_deadline``); a node that has not
  listed yet answers "not held";
- **the directory**: who lists the model, with which zone, and who holds it all, as the
  LocalModelNode statuses say, seen ``--directory-delay`` seconds late;
- **links**: the origin (a time to first byte, a cap per connection, a cap per zone and one in
  all), each node's NIC (each direction), the links between zones (a cap per pair) and latency
  (one way, within a zone and between zones). A link's capacity is shared equally by the flows
  on it; a flow goes at the smallest share along its path (no re-distribution of what a flow
  bottlenecked elsewhere leaves: slightly pessimistic when NICs are the limit);
- **CPU**: a byte a node takes in (origin or peer: the read, sha-256, a peer's TLS) costs
  ``--cpu-in`` CPU-s per GiB, a byte it sends to a peer ``--cpu-sent``, a long poll answered
  ``--cpu-poll`` per 1,000 (half on each end), and an agent uses ``--cpu-idle`` cores whatever it
  does. Each agent's cores are a link like the others, shared equally by its flows (a poll's
  reply is a flow of its CPU: it waits for the cores like a transfer), and never more than one
  core (``--gil``: an agent's Python runs one thread at a time). A fleet (the default): each
  node its own ``--cpus`` (deploy/'s agent limit, 2; the agent uses 1 of them). One machine
  (``--cpus-shared``, bench/fleet.py's run): the scheduler's fair share of its cores, each agent
  with work one runnable thread beside the other processes' (``Machine``), over time as the
  run's repeated probe measured them.

Reported (``--json``): time until every node holds the model, as a multiple of one node alone
(the same world, one node, no peers), and the origin's bytes per zone as a multiple of the model.
``--validate FLEET_JSON ...`` (default: bench/fleet.py's own runs at 8 and 16 nodes,
``FLEET_RESULTS``) also simulates each bench/fleet.py run (its nodes, model and origin rate) and
compares with what the real agents did: ``validated_against_fleet`` is true when both figures
(time as a multiple of one node, origin bytes as a multiple of the model) are within 15 % of the
real ones for every run (``validation``). That world is the run's machine: its cores, the other
processes its repeated probe measured, and the CPU its agents paid: the quiet costs times what the
run's own agents paid over them (``contention``; ``--cpu-costs FLEET_JSON ...``: those runs'
together), so the time checks the machine's share and the swarm's dynamics, not a byte's cost.
A run that recorded its agents' CPU beside each probe sample (bench/fleet.py's
``agents_during_p2p``) also gets, window by window, each agent's cores used next to the cores
the model offers it then (``cpu_per_window``, printed as a table on stderr); older runs: None.

    .venv/bin/python bench/swarm_sim.py --nodes 1000 --zones 3 [--size 2Gi] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import inspect
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modelcache.engine.transfer_control import SourceStats  # noqa: E402
from modelcache.peers.client import PeerInfo  # noqa: E402
from modelcache.peers.pieces import PIECE_MAX, piece_count, piece_span  # noqa: E402
from modelcache.peers.plan import PeerState, Plan, choose_peers  # noqa: E402
from modelcache.peers.server import SLOT_WAIT  # noqa: E402
from modelcache.peers.settings import SwarmSettings  # noqa: E402
from modelcache.runtime.sizes import parse_size  # noqa: E402

#: Whether this tree's plan cuts files into blocks (an older one, measured for comparison, does not).
BLOCKS = "counts" in inspect.signature(Plan).parameters
#: The engine's window of pending pieces offered to ``pick`` (modelcache/engine/transfer.py).
PICK_WINDOW = 64
MiB = 1 << 20

# ---------------------------------------------------------------------------------------------
# The clock and the processes
# ---------------------------------------------------------------------------------------------

Proc = Generator[Any, Any, None]


class Sim:
    """Virtual time, and processes written as generators that yield what they wait for:
    ``Sleep(s)``, ``Wait(cond, timeout)`` or a ``Flow`` (its bytes moved, or cut)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events = 0
        self.finished = 0  # processes that said they are done (the run's end condition counts them)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def spawn(self, proc: Proc) -> None:
        self.at(self.now, lambda: self.step(proc, None))

    def step(self, proc: Proc, value: Any) -> None:
        try:
            cmd = proc.send(value)
        except StopIteration:
            return
        cmd.park(self, proc)

    def run(self, until: Callable[[], bool], limit: float) -> None:
        while self._heap and not until():
            t, _, fn = heapq.heappop(self._heap)
            if t > limit:
                raise RuntimeError(f"the swarm did not finish in {limit:.0f} simulated seconds")
            self.now = t
            self.events += 1
            fn()


@dataclass
class Sleep:
    seconds: float

    def park(self, sim: Sim, proc: Proc) -> None:
        sim.at(sim.now + self.seconds, lambda: sim.step(proc, None))


class Cond:
    """What ``threading.Condition.wait(timeout)`` is to the real code: woken by ``notify_all``."""

    def __init__(self) -> None:
        self.waiting: dict[int, tuple[Proc, int]] = {}
        self._ids = itertools.count()

    def notify_all(self, sim: Sim) -> None:
        waiting, self.waiting = self.waiting, {}
        for proc, _ in waiting.values():
            sim.at(sim.now, lambda p=proc: sim.step(p, True))


@dataclass
class Wait:
    cond: Cond
    timeout: float

    def park(self, sim: Sim, proc: Proc) -> None:
        token = next(self.cond._ids)
        self.cond.waiting[token] = (proc, token)

        def expire() -> None:
            if self.cond.waiting.pop(token, None) is not None:
                sim.step(proc, False)

        sim.at(sim.now + self.timeout, expire)


# ---------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------


class Link:
    __slots__ = ("cap", "flows", "machine", "name")

    def __init__(self, cap: float, name: str) -> None:
        self.cap, self.name = cap, name
        self.flows: dict[Flow, None] = {}  # insertion-ordered: the same run gives the same result
        self.machine: Machine | None = None  # an agent's CPU on a shared machine: told when it runs or stops


class Flow:
    """``nbytes`` over ``links`` (and at most ``cap`` bytes/s), after ``delay`` seconds (a first
    byte's latency). Yielded by a process: resumed with True once moved, False if cut at
    ``deadline``."""

    __slots__ = ("cap", "cost", "counted", "deadline", "delay", "done", "links", "nbytes", "proc", "rate", "remaining",
                 "t0", "version")

    def __init__(self, links: list[Link], nbytes: int, cap: float = math.inf, delay: float = 0.0,
                 deadline: float = math.inf, cpu: list[tuple[Link, float]] | None = None) -> None:
        # CPU pools are links whose capacity is cores (CPU-s per s), each with this flow's cost in
        # CPU-s per byte: a pool named twice (both ends on the machine's shared cores) pays both.
        self.cost: dict[Link, float] = {}
        for pool, per_byte in cpu or ():
            if per_byte > 0:
                self.cost[pool] = self.cost.get(pool, 0.0) + per_byte
        # A link without a limit shares nothing: only counted (its flows would otherwise all be
        # rescheduled whenever one starts or ends: O(flows) per event on a fleet-wide origin).
        self.counted = [link.name for link in links]
        links = [link for link in links if math.isfinite(link.cap)] + list(self.cost)
        self.links, self.nbytes, self.cap, self.delay, self.deadline = links, nbytes, cap, delay, deadline
        self.remaining = float(nbytes)
        self.rate = 0.0
        self.t0 = 0.0
        self.version = 0
        self.done = False
        self.proc: Proc | None = None

    def park(self, sim: Sim, proc: Proc) -> None:
        self.proc = proc
        net: Net = sim.net  # type: ignore[attr-defined]
        sim.at(sim.now + self.delay, lambda: net.start(self))


class Net:
    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.moved: dict[str, float] = {}

    def _settle(self, f: Flow) -> None:
        now = self.sim.now
        f.remaining = max(0.0, f.remaining - f.rate * (now - f.t0))
        f.t0 = now

    def _reschedule(self, flows: dict[Flow, None]) -> None:
        now = self.sim.now
        for f in flows:
            rate = f.cap
            for link in f.links:
                # A link's capacity shared equally by its flows; a CPU pool's cores likewise (each
                # flow a thread the scheduler treats alike), its share in bytes/s by the flow's cost.
                rate = min(rate, link.cap / (len(link.flows) * f.cost.get(link, 1.0)))
            if rate == f.rate and f.version:
                continue  # its bottleneck is elsewhere: the end already scheduled holds
            self._settle(f)
            f.rate = rate
            f.version += 1
            v = f.version
            end = now + (f.remaining / rate if rate > 0 else math.inf)
            if end > f.deadline:
                self.sim.at(f.deadline, lambda f=f, v=v: self._finish(f, v, False))
            elif math.isfinite(end):
                self.sim.at(end, lambda f=f, v=v: self._finish(f, v, True))

    def set_cap(self, link: Link, cap: float) -> None:
        """The link's capacity changes now (a machine's cores as other processes come and go)."""
        if cap != link.cap:
            for f in link.flows:
                self._settle(f)
            link.cap = cap
            self._reschedule(link.flows)

    def start(self, f: Flow) -> None:
        if self.sim.now >= f.deadline:
            self.sim.step(f.proc, False)  # type: ignore[arg-type]
            return
        f.t0 = self.sim.now
        touched: dict[Flow, None] = {f: None}
        for link in f.links:
            link.flows[f] = None
            touched.update(link.flows)
        for link in f.links:
            if link.machine is not None:
                link.machine.changed(link)  # one more runnable thread
        self._reschedule(touched)

    def _finish(self, f: Flow, version: int, whole: bool) -> None:
        if f.done or version != f.version:
            return
        self._settle(f)
        f.done = True
        touched: dict[Flow, None] = {}
        for link in f.links:
            link.flows.pop(f, None)
            touched.update(link.flows)
        for link in f.links:
            if link.machine is not None:
                link.machine.changed(link)
        moved = f.nbytes - (0 if whole else f.remaining)
        for name in f.counted:
            self.moved[name] = self.moved.get(name, 0.0) + moved
        self._reschedule(touched)
        self.sim.step(f.proc, whole)  # type: ignore[arg-type]


class Machine:
    """One machine's cores shared by agents and other processes (bench/fleet.py's run): the
    scheduler gives every runnable thread an equal share (CFS), and an agent is one runnable
    thread, whatever its streams and polls: its work is Python, run one thread at a time (the
    GIL). Measured: in bench/fleet.py's 8-agent runs each agent got 0.90-1.11x the share the
    probe (one more runnable process) got beside it (fleet-8-stop38.json, load 11-28: 0.97 cores
    for 8 agents at a probe's mean 0.135; fleet-8-probed.json: 1.09 at 0.123). So an agent with
    work gets ``cpus / (others + agents with work)`` cores, at most ``gil`` (one core), less
    what it uses whatever it does (``idle``); ``others``: the runnable threads of other processes,
    from the probe over time (``others_over_time``). Its flows share that equally."""

    def __init__(self, net: Net, cpus: float, others: float, gil: float, idle: float) -> None:
        self.net, self.cpus, self.others, self.gil, self.idle = net, cpus, others, gil, idle
        self.agents: list[Link] = []
        self.busy: dict[Link, None] = {}

    def agent(self, name: str) -> Link:
        link = Link(self.share(1), name)
        link.machine = self
        self.agents.append(link)
        return link

    def cores(self, runnable: int) -> float:
        """An agent's cores when ``runnable`` agents have work: its fair share, at most ``gil``."""
        return min(self.gil, self.cpus / max(1e-9, self.others + runnable))

    def share(self, runnable: int) -> float:
        cores = self.cores(runnable)
        return max(0.01 * cores, cores - self.idle)

    def changed(self, link: Link) -> None:
        if bool(link.flows) != (link in self.busy):
            if link.flows:
                self.busy[link] = None
            else:
                self.busy.pop(link, None)
            self.apply()

    def load(self, others: float) -> None:
        """Other processes came or went (a probe sample)."""
        self.others = others
        self.apply()

    def apply(self) -> None:
        # An agent without work gets what it would get on starting some: the same share.
        cap = self.share(max(1, len(self.busy)))
        for link in self.agents:
            self.net.set_cap(link, cap)


# ---------------------------------------------------------------------------------------------
# The world
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    nodes: int
    zones: int
    files: tuple[int, ...]  # sizes, in path order
    workers: int = 8
    #: The agent's --chunk-size: a node alone (no peers) reads chunks of it.
    chunk_size: int = 8 * MiB
    #: Origin: seconds to a response's first byte; bytes/s per connection, per zone, in all.
    origin_ttfb: float = 0.05
    origin_stream: float = math.inf
    origin_zone: float = math.inf
    origin_total: float = math.inf
    nic: float = 25e9 / 8
    inter_zone: float = math.inf
    latency: float = 0.0005
    inter_zone_latency: float = 0.002
    #: Seconds from the cache's creation until a node starts (lists the model): from .. to.
    start: tuple[float, float] = (0.5, 1.5)
    #: Seconds until the directory shows what a node published (its LocalModelNode status).
    directory_delay: float = 1.0
    #: Seconds after its last piece until a node says Downloaded (verify, publish, status).
    finish: float = 0.5
    max_uploads: int = 4
    #: The CPU model: CPU-s per byte a node takes in from a peer (the read, sha-256, TLS) and
    #: from the origin (``cpu_origin``; < 0: as from a peer), per byte it sends to a peer (TLS,
    #: the read), per long poll answered (``cpu_poll``: the request, the reply's JSON, TLS; half
    #: on each end), and the cores an agent uses whatever it transfers (``cpu_idle``: watches,
    #: status writes; bench/fleet.py measures it once the model is everywhere); ``cpus`` cores
    #: per node (``cpu_shared`` False: a fleet, each node its own cores) or for all nodes together
    #: (``cpu_shared`` True: agents sharing one machine, as bench/fleet.py's run: ``Machine``).
    #: An agent uses at most ``gil`` cores whatever it has (its Python runs one thread at a time:
    #: ``Machine``; 0: no such bound). ``cpus`` 0: no CPU model (CPU never the limit).
    cpus: float = 0.0
    cpu_shared: bool = False
    gil: float = 1.0  # GIL_CORES
    #: With ``cpu_shared``: the share of a core one more process got on the machine before the
    #: agents worked (measured by bench/fleet.py's probe): ``cpus / share - 1`` other runnable
    #: threads. 0: the machine is the agents' alone.
    cpu_share: float = 0.0
    #: With ``cpu_shared``: the other processes' runnable threads over time, (seconds since the
    #: start, how many), from bench/fleet.py's probe repeated during the run; replaces
    #: ``cpu_share`` from the first on.
    cpu_others: tuple[tuple[float, float], ...] = ()
    cpu_pull: float = 0.0
    cpu_serve: float = 0.0
    cpu_origin: float = -1.0
    cpu_poll: float = 0.0
    cpu_idle: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    seed: int = 1
    peers: bool = True
    #: Virtual times at which to sample the cores the agents use (their flows' CPU and idle use):
    #: ``simulate``'s ``cpu_trace``, set beside bench/fleet.py's measured ones (``cpu_per_window``).
    cpu_trace: tuple[float, ...] = ()

    @property
    def size(self) -> int:
        return sum(self.files)


class Directory:
    """What every agent's directory shows (LocalModelNode statuses), ``directory_delay`` late."""

    def __init__(self, sim: Sim, world: World) -> None:
        self.sim, self.world = sim, world
        self.listed: dict[str, tuple[str, bool]] = {}  # node -> (zone, complete)
        self.members: dict[str, str] = {}  # every node the cache names: node -> zone
        self.version = 0

    def publish(self, node: str, zone: str, complete: bool) -> None:
        def show() -> None:
            self.listed[node] = (zone, complete)
            self.version += 1
        self.sim.at(self.sim.now + self.world.directory_delay, show)

    def peers(self) -> list[PeerInfo]:
        out = []
        for name, zone in self.members.items():
            listed = self.listed.get(name)
            digest = "d" if listed is not None else None
            out.append(PeerInfo(name, name, 1, "0" * 64, zone, digest, bool(listed and listed[1])))
        return out


class PollLink:
    """One polled peer: its state in our plan, and the long poll that keeps it current."""

    def __init__(self, node: Node, target: Node) -> None:
        self.node, self.target = node, target
        self.state = PeerState(target.name, target.zone, False)
        self.stopped = False
        self.digest: str | None = None
        self.wake = Cond()


class Node:
    def __init__(self, sim: Sim, world: World, index: int, zone: int, directory: Directory,
                 nodes: dict[str, Node], origin_links: list[Link]) -> None:
        self.sim, self.world, self.directory, self.nodes = sim, world, directory, nodes
        self.name = f"node-{index:04d}"
        self.zone = f"zone-{zone}"
        self.zone_index = zone
        self.up = Link(world.nic, f"{self.name}/up")
        self.down = Link(world.nic, f"{self.name}/down")
        self.origin_links = origin_links
        self.cpu: Link | None = None  # its CPU pool (simulate() sets it)
        settings = SwarmSettings(node=self.name, zone=self.zone, **world.settings)
        self.settings = settings
        extra = {"counts": tuple(piece_count(size, PIECE_MAX) for size in world.files)} if BLOCKS else {}
        self.plan = Plan(settings, "model", world.workers, clock=lambda: sim.now,
                         checked=frozenset(range(len(world.files))), files=len(world.files), **extra)
        self.cond = Cond()  # the session's condition: waiting streams
        # With peers the engine's chunks are pieces (pull.py); without, the agent's --chunk-size.
        self.piece_size = PIECE_MAX if world.peers else world.chunk_size
        self.stats = SourceStats(self.piece_size)
        self.pieces = [(ci, p) for ci, size in enumerate(world.files)
                       for p in range(piece_count(size, self.piece_size))]
        self.pending: list[list[int]] = [list(range(piece_count(size, self.piece_size))) for size in world.files]
        self.active = [0] * len(world.files)
        self.fetching: set[tuple[int, int]] = set()  # pieces we read from the origin right now
        self.served: list[tuple[int, int, str, bool]] = []
        self.held: set[tuple[int, int]] = set()
        self.news = Cond()  # long polls waiting for news
        self.claims = 0
        self.listed = False
        self.done_at: float | None = None
        self.links: dict[str, PollLink] = {}
        self.slots = 0
        self.slot_waiters: list[Proc] = []
        self.from_origin = 0
        self.from_peers = 0
        self.dir_version = -1
        self.started_at = 0.0
        self.polls_answered = 0
        self.polled_by = 0  # peers polling us now: each holds a connection (and a server thread)
        self.most_polled_by = 0
        self.most_links = 0
        # What bench/fleet.py counts in the agents' logs (PEER_EVENTS): reads past their deadline,
        # pieces read from the origin after their budget, owners waited for in vain.
        self.events = {"too_slow": 0, "origin_fallbacks": 0, "owners_missed": 0}

    # ---- the agent -----------------------------------------------------------------------------

    def run(self) -> Proc:
        w = self.world
        yield Sleep(self.started_at)
        self.listed = True  # listed: its session serves what it gets from now on
        self.plan.formed_at = self.sim.now + self.settings.formation
        self.directory.publish(self.name, self.zone, False)
        if w.peers:
            self.sim.spawn(self.refresher())
        for _ in range(w.workers):
            self.sim.spawn(self.stream())

    def refresher(self) -> Proc:
        """SwarmSession.refresh every ``refresh`` seconds (a no-op while the directory is unchanged)."""
        while self.done_at is None:
            if self.directory.version != self.dir_version:
                self.dir_version = self.directory.version
                self.refresh()
            yield Sleep(self.settings.refresh)

    def refresh(self) -> None:
        infos = [p for p in self.directory.peers() if p.name != self.name and p.digest in (None, "d")]
        wanted = {p.name: p for p in choose_peers(infos, self.settings)}
        for name in [n for n in self.links if n not in wanted]:
            link = self.links.pop(name)
            link.stopped = True
            link.wake.notify_all(self.sim)
            self.plan.remove(name)
        for name, info in wanted.items():
            link = self.links.get(name)
            if link is None:
                link = self.links[name] = PollLink(self, self.nodes[name])
                self.plan.add(link.state)
                self.sim.spawn(self.poll(link))
            elif info.digest != link.digest:
                link.wake.notify_all(self.sim)  # it has listed: poll it now
            link.digest = info.digest
            if hasattr(self.plan, "listed"):
                self.plan.listed(name, info.zone, info.complete)
            else:
                link.state.zone, link.state.listed_complete = info.zone, info.complete
        self.most_links = max(self.most_links, len(self.links))
        self.plan_directory()
        self.cond.notify_all(self.sim)

    def plan_directory(self) -> None:
        """Where the plan takes members from the directory too (the design at scale)."""
        swarm = getattr(self.plan, "swarm", None)
        if swarm is not None:
            swarm({p.name: (p.zone, p.digest is not None) for p in self.directory.peers()
                   if p.name != self.name and not p.complete})

    def latency_to(self, other: Node) -> float:
        return self.world.latency if other.zone == self.zone else self.world.inter_zone_latency

    def poll(self, link: PollLink) -> Proc:
        """PeerLink._poll_loop: a long poll of the target's ``have``."""
        target, state = link.target, link.state
        target.polled_by += 1
        target.most_polled_by = max(target.most_polled_by, target.polled_by)
        try:
            yield from self._poll(link, target, state)
        finally:
            target.polled_by -= 1

    def _poll(self, link: PollLink, target: Node, state: PeerState) -> Proc:
        seq, epoch = 0, "-"
        while not link.stopped and self.done_at is None:
            wait = 0.0 if epoch == "-" or state.complete else self.settings.poll_wait
            yield Sleep(self.latency_to(target))
            if not target.listed:  # 404: not held (still listing)
                yield Sleep(target.latency_to(self))
                self.plan.lost(state, True)
                self.cond.notify_all(self.sim)
                yield Wait(link.wake, 0.5)
                continue
            claims = target.claims
            if epoch != "-" and len(target.served) == seq and wait > 0:
                deadline = self.sim.now + wait
                while len(target.served) == seq and target.claims == claims and self.sim.now < deadline:
                    yield Wait(target.news, deadline - self.sim.now)
            full = epoch == "-"
            pieces = target.served if full else target.served[seq:]
            pieces = list(pieces)
            fetching = list(target.fetching)
            complete = target.done_at is not None
            seq, epoch = len(target.served), "e"
            target.polls_answered += 1
            if self.world.cpu_poll > 0 and self.cpu is not None and target.cpu is not None:
                # The reply's CPU on both ends, on cores shared with every transfer there.
                half = self.world.cpu_poll / 2
                yield Flow([], 1, cpu=[(target.cpu, half), (self.cpu, half)])
            yield Sleep(target.latency_to(self))
            if link.stopped or self.done_at is not None:
                return
            self.plan.heard(state, full, pieces, fetching, complete)
            self.cond.notify_all(self.sim)
            if state.complete:
                yield Wait(link.wake, 30.0)
            else:
                yield Sleep(self.settings.poll_gap)

    # ---- the engine ---------------------------------------------------------------------------

    def _take(self) -> tuple[int, list[int]] | None:
        """TransferEngine._take: the file with the fewest streams, the piece ``pick`` names among
        its next pending ones, and the pieces after it while they are consecutive, up to the
        source's run length (SourceStats: longer runs where responses are slow to start)."""
        best = None
        for ci, pending in enumerate(self.pending):
            if pending and (best is None or self.active[ci] < self.active[best]):
                best = ci
        if best is None:
            return None
        pending = self.pending[best]
        first = 0
        if self.world.peers:
            window = pending[:PICK_WINDOW]
            fetching = {p for f, p in self.fetching if f == best}
            first = min(max(0, self.plan.pick(best, window, fetching)), len(window) - 1)
        run = [pending.pop(first)]
        limit = self.stats.run_length
        if self.world.peers and hasattr(self.plan, "swarm"):
            # PeerSource.chunk_run: a run only of pieces read from the origin in one request.
            while (len(run) < limit and first < len(pending) and pending[first] == run[-1] + 1
                   and self.plan.owns(best, run[0]) and self.plan.owns(best, pending[first])):
                run.append(pending.pop(first))
        elif first == 0:
            while len(run) < limit and pending and pending[0] == run[-1] + 1:
                run.append(pending.pop(0))
        return best, run

    def stream(self) -> Proc:
        while True:
            task = self._take()
            if task is None:
                return
            ci, run = task
            self.active[ci] += 1
            opened = self.sim.now
            got, first_byte = yield from (self.run_pieces(ci, run) if self.world.peers else self.run_origin(ci, run))
            self.active[ci] -= 1
            if got:
                self.stats.observe(first_byte - opened, got, max(1e-6, self.sim.now - first_byte))
            if len(self.held) == len(self.pieces) and self.done_at is None:
                yield Sleep(self.world.finish)
                if self.done_at is None:
                    self.done_at = self.sim.now
                    self.sim.finished += 1
                    self.directory.publish(self.name, self.zone, True)
                    self.news.notify_all(self.sim)

    def pull_cost(self, origin: bool = False) -> list[tuple[Link, float]]:
        w = self.world
        per_byte = w.cpu_origin if origin and w.cpu_origin >= 0 else w.cpu_pull
        return [] if self.cpu is None else [(self.cpu, per_byte)]

    def span(self, ci: int, piece: int) -> int:
        start, end = piece_span(self.world.files[ci], self.piece_size, piece)
        return end - start

    def run_origin(self, ci: int, run: list[int]) -> Generator[Any, Any, tuple[int, float]]:
        """Without peers: one ranged request for the run of chunks."""
        nbytes = sum(self.span(ci, p) for p in run)
        yield Sleep(self.world.origin_ttfb)
        first_byte = self.sim.now
        yield Flow([*self.origin_links, self.down], nbytes, cap=self.world.origin_stream,
                   cpu=self.pull_cost(origin=True))
        self.from_origin += nbytes
        for p in run:
            self.record(ci, p, True)
        return nbytes, first_byte

    def run_pieces(self, ci: int, run: list[int]) -> Generator[Any, Any, tuple[int, float]]:
        """PieceStream over a run: each piece from a peer, or from the origin (a run of
        consecutive pieces we own in one request, cut short when the next is no longer ours)."""
        got, first_byte, i = 0, math.nan, 0
        while i < len(run):
            piece = run[i]
            source = yield from self.acquire(ci, piece)
            if source is not None:  # a peer's verified piece
                got += self.span(ci, piece)
                if math.isnan(first_byte):
                    first_byte = self.sim.now
                i += 1
                continue
            last = i + 1
            while last < len(run) and self.plan.owns(ci, run[last]):
                last += 1
            claimed = run[i:last]
            self.fetching.update((ci, p) for p in claimed)
            self.claims += 1
            self.news.notify_all(self.sim)
            yield Sleep(self.world.origin_ttfb)
            if math.isnan(first_byte):
                first_byte = self.sim.now
            for j, p in enumerate(claimed):
                nbytes = self.span(ci, p)
                yield Flow([*self.origin_links, self.down], nbytes, cap=self.world.origin_stream,
                           cpu=self.pull_cost(origin=True))
                self.from_origin += nbytes
                got += nbytes
                self.fetching.discard((ci, p))
                self.claims += 1
                self.plan.settle(ci, p, f"{ci}.{p}")
                self.record(ci, p, True)
                i += 1
                if j + 1 < len(claimed) and not self.plan.owns(ci, claimed[j + 1]):
                    for rest in claimed[j + 1:]:
                        self.fetching.discard((ci, rest))
                    self.claims += 1
                    self.news.notify_all(self.sim)
                    break
            self.plan.release_origin()
            self.cond.notify_all(self.sim)
        return got, first_byte

    def acquire(self, ci: int, piece: int) -> Generator[Any, Any, str | None]:
        """SwarmSession.acquire: the piece from a peer (returns who), or None: read it from the
        origin (an origin read taken)."""
        nbytes = self.span(ci, piece)
        started = self.sim.now
        while True:
            step = self.plan.step(ci, piece, started)
            if step.missed is not None and not step.late:
                self.events["owners_missed"] += 1
            if step.origin and self.plan.take_origin(force=step.late):
                if step.late:
                    self.events["origin_fallbacks"] += 1
                    if step.missed is not None:
                        self.plan.missed(step.missed)
                return None
            for name in step.holders:
                link = self.links.get(name)
                if link is None:
                    continue
                got = yield from self.from_peer(link, ci, piece, nbytes, started)
                if got:
                    return name
            yield Wait(self.cond, 0.2)

    def from_peer(self, link: PollLink, ci: int, piece: int, nbytes: int, started: float) -> Generator[Any, Any, bool]:
        """SwarmSession._fetch: one request to one holder."""
        name = link.target.name
        expected = self.plan.expected(name, ci, piece)
        if expected is None:
            return False
        state = link.state
        state.inflight += 1
        target = link.target
        try:
            yield Sleep(self.latency_to(target))
            slot = yield from target.upload_slot()
            if not slot:  # 503, Retry-After: 1
                yield Sleep(target.latency_to(self))
                self.plan.busy(name, 1.0)
                return False
            try:
                deadline = self.settings.read_deadline(self.sim.now, started, nbytes)
                path = [target.up, self.down]
                if target.zone != self.zone:
                    path.append(self.world_links[(target.zone_index, self.zone_index)])
                cpu = self.pull_cost()
                if target.cpu is not None:
                    cpu = [*cpu, (target.cpu, self.world.cpu_serve)]
                whole = yield Flow(path, nbytes, delay=target.latency_to(self), deadline=deadline,
                                   cpu=cpu)
            finally:
                target.release_slot()
        finally:
            state.inflight -= 1
        if not whole:
            self.events["too_slow"] += 1
            self.plan.slow(name)
            return False
        self.from_peers += nbytes
        self.plan.delivered(name)
        self.plan.took(name, ci, piece, expected)
        self.record(ci, piece, False)
        return True

    world_links: dict[tuple[int, int], Link] = {}

    def record(self, ci: int, piece: int, origin: bool) -> None:
        if (ci, piece) in self.held:
            return
        self.held.add((ci, piece))
        self.served.append((ci, piece, f"{ci}.{piece}", origin))
        self.news.notify_all(self.sim)

    # ---- the peer server -------------------------------------------------------------------------

    def upload_slot(self) -> Generator[Any, Any, bool]:
        deadline = self.sim.now + SLOT_WAIT
        while self.slots >= self.world.max_uploads:
            if self.sim.now >= deadline:
                return False
            cond = Cond()
            self.slot_waiters.append(cond)  # type: ignore[arg-type]
            yield Wait(cond, deadline - self.sim.now)
        self.slots += 1
        return True

    def release_slot(self) -> None:
        self.slots -= 1
        waiters, self.slot_waiters = self.slot_waiters, []
        for cond in waiters:
            cond.notify_all(self.sim)  # type: ignore[attr-defined]


def others_before(cpus: float, share: float) -> float:
    """Other runnable threads on ``cpus`` cores where one more process (the probe, the agents
    idle) got ``share`` of a core: the scheduler's fair share ``cpus / (others + 1)``; 0: none."""
    return max(0.0, cpus / share - 1) if share > 0 else 0.0


def agent_cores(world: World) -> float:
    """A fleet node's cores for its agent: its own ``cpus``, at most ``gil``, less its idle use."""
    cores = min(world.cpus, world.gil) if world.gil > 0 else world.cpus
    return max(0.01 * cores, cores - world.cpu_idle)


def machine_load(sim: Sim, machine: Machine, world: World) -> Proc:
    """The other processes on the machine over time, as the probe measured them (``cpu_others``:
    a step at each sample)."""
    for at, others in world.cpu_others:
        if at > sim.now:
            yield Sleep(at - sim.now)
        machine.load(others)


def cores_in_use(pools: list[Link], idle: float) -> float:
    """The cores the agents use now, all together: each flow's rate times its CPU cost on each
    agent's pool, and each agent's idle use."""
    return sum(f.rate * f.cost.get(pool, 0.0) for pool in pools for f in pool.flows) + idle * len(pools)


def simulate(world: World, limit: float = 36000.0) -> dict[str, Any]:
    """Run the swarm; returns when every node holds the model."""
    sim = Sim()
    sim.net = Net(sim)  # type: ignore[attr-defined]
    rng = random.Random(world.seed)
    total = Link(world.origin_total, "origin")
    zone_origin = [Link(world.origin_zone, f"origin/zone-{z}") for z in range(world.zones)]
    pair = {(a, b): Link(world.inter_zone, f"zone-{a}->zone-{b}") for a in range(world.zones)
            for b in range(world.zones) if a != b}
    Node.world_links = pair
    directory = Directory(sim, world)
    nodes: dict[str, Node] = {}
    machine = None
    if world.cpus > 0 and world.cpu_shared:
        machine = Machine(sim.net, world.cpus, others_before(world.cpus, world.cpu_share),  # type: ignore[attr-defined]
                          world.gil if world.gil > 0 else math.inf, world.cpu_idle)
        if world.cpu_others:
            sim.spawn(machine_load(sim, machine, world))
    for i in range(world.nodes):
        z = i % world.zones
        node = Node(sim, world, i, z, directory, nodes, [total, zone_origin[z]])
        if machine is not None:
            node.cpu = machine.agent(f"{node.name}/cpu")
        elif world.cpus > 0:
            node.cpu = Link(agent_cores(world), f"{node.name}/cpu")
        node.started_at = rng.uniform(*world.start)
        nodes[node.name] = node
        directory.members[node.name] = node.zone
    for node in nodes.values():
        sim.spawn(node.run())
    wall = time.monotonic()
    trace: list[tuple[float, float]] = []
    pools = [n.cpu for n in nodes.values() if n.cpu is not None]
    for at in world.cpu_trace if pools else ():
        sim.at(at, lambda at=at: trace.append((at, cores_in_use(pools, world.cpu_idle))))
    sim.run(lambda: sim.finished >= len(nodes), limit)
    done = max(n.done_at or 0.0 for n in nodes.values())
    per_zone = [sum(n.from_origin for n in nodes.values() if n.zone_index == z) for z in range(world.zones)]
    return {
        "seconds": done,
        "origin_bytes": sum(per_zone),
        "origin_per_zone": [b / world.size for b in per_zone],
        "peer_bytes": sum(n.from_peers for n in nodes.values()),
        "inter_zone_bytes": sum(v for k, v in sim.net.moved.items() if "->" in k),  # type: ignore[attr-defined]
        "most_polled_by": max(n.most_polled_by for n in nodes.values()),
        "most_polling": max(n.most_links for n in nodes.values()),
        "polls_answered": sum(n.polls_answered for n in nodes.values()),
        "peer_events": {k: sum(n.events[k] for n in nodes.values()) for k in ("too_slow", "origin_fallbacks",
                                                                            "owners_missed")},
        "events": sim.events, "wall_seconds": round(time.monotonic() - wall, 1),
        "cpu_trace": trace,
    }


def cpu_model(world: World) -> dict[str, Any] | None:
    """The CPU model a run used, as its JSON says it (per GiB, per 1,000 polls)."""
    if world.cpus <= 0:
        return None
    gib = 1 << 30
    origin = world.cpu_origin if world.cpu_origin >= 0 else world.cpu_pull
    return {"cores": world.cpus, "shared": world.cpu_shared, "gil_cores": world.gil, "share_per_agent": world.cpu_share,
            "others_over_time": len(world.cpu_others) or None,
            "cpu_s_per_gib_in": round(world.cpu_pull * gib, 3),
            "cpu_s_per_gib_from_origin": round(origin * gib, 3),
            "cpu_s_per_gib_sent": round(world.cpu_serve * gib, 3),
            "cpu_s_per_1000_polls": round(world.cpu_poll * 1000, 3), "cores_idle_per_agent": round(world.cpu_idle, 4)}


def scenario(world: World, alone_world: World | None = None) -> dict[str, Any]:
    """The swarm, and one node alone in the same world (or in ``alone_world``: bench/fleet.py's
    single run had its own machine load)."""
    swarm = simulate(world)
    alone = simulate(alone_world or World(**{**world.__dict__, "nodes": 1, "zones": 1, "peers": False}))
    return {
        "nodes": world.nodes, "zones": world.zones, "model_bytes": world.size,
        "seconds": round(swarm["seconds"], 2), "seconds_single": round(alone["seconds"], 2),
        "time_vs_single": round(swarm["seconds"] / alone["seconds"], 3),
        "origin_per_zone_vs_model": round(max(swarm["origin_per_zone"]), 3),
        "origin_per_zone": [round(x, 3) for x in swarm["origin_per_zone"]],
        "inter_zone_bytes_vs_model": round(swarm["inter_zone_bytes"] / world.size, 3),
        "most_polled_by": swarm["most_polled_by"], "most_polling": swarm["most_polling"],
        "polls_answered": swarm["polls_answered"], "peer_events": swarm["peer_events"],
        "events": swarm["events"], "wall_seconds": swarm["wall_seconds"], "cpu_model": cpu_model(world),
        "cpu_trace": swarm["cpu_trace"],
    }


def model_sizes(total: int, shards: int) -> tuple[int, ...]:
    """A config and ``shards`` weight files of about ``total`` bytes (tests/fleet.model_files)."""
    size = max(1, total // shards)
    files = {"config.json": 40, **{f"model-{i + 1:05d}-of-{shards:05d}.safetensors": size + i * 4099
                                   for i in range(shards)}}
    return tuple(files[k] for k in sorted(files))


#: A fleet's CPU (the CLI's default): each node its own cores, as many as deploy/'s agent may use
#: (deploy/agent/daemonset.yaml: limits cpu 2). CPU-s per GiB taken in: the agent's pull at a
#: 1-CPU quota (docs/benchmarks.md, issue 28: 0.79). Per GiB sent to a peer: that times what
#: bench/fleet.py measured a sent byte to cost against a byte taken in (bench/fleet-8-cpu.json:
#: 4.15 / 8.14 CPU-s per GiB on the loaded 2-core machine). Per 1,000 polls answered, both ends:
#: bench/poll_cost.py (CPU time, a real server and client over TLS). Idle cores per agent: none
#: charged (bench/fleet.py measures 0.10-0.20 CPU-s a minute, ``idle_cores``: 0.003 cores; a
#: node of its own has its 2 cores for the agent, which uses one: ``GIL_CORES``).
NODE_CPUS = 2.0
CPU_IN_PER_GIB = 0.79
CPU_SENT_PER_GIB = 0.40
CPU_POLL_PER_1000 = 0.84
CPU_IDLE_CORES = 0.0
#: The cores an agent can use: one. Its work is Python (the engine's loop over TLS records and
#: hash updates, the peer server, the polls), run one thread at a time; measured on the shared
#: machine, an agent with work took 0.90-1.11x the share of one more runnable process (the
#: probe) at 8 nodes, whatever its 8 streams and 7 polls (fleet-8-stop38.json, fleet-8-probed.json).
GIL_CORES = 1.0

#: How close the simulation must come to bench/fleet.py's real run (both figures), relative.
TOLERANCE = 0.15
#: bench/fleet.py's own runs (README) on this code (stop 39: a busy holder that served us waited to
#: the stall bound), what every run is validated against by default, each at the CPU its own agents
#: paid (``contention``). The earlier runs (fleet-*-stop38.json, -probed, ...) are kept as they were.
FLEET_RESULTS = (REPO / "bench" / "fleet-8-stop39.json", REPO / "bench" / "fleet-16-stop39.json")


@dataclass(frozen=True)
class CpuCosts:
    """CPU-s per byte taken in from a peer, per byte sent to a peer, per byte taken in from the
    origin (< 0: as from a peer), per poll answered (both ends), and cores an agent uses whatever
    it transfers."""

    pull: float
    serve: float
    origin: float = -1.0
    poll: float = 0.0
    idle: float = 0.0

    def world(self) -> dict[str, float]:
        return {"cpu_pull": self.pull, "cpu_serve": self.serve, "cpu_origin": self.origin, "cpu_poll": self.poll,
                "cpu_idle": self.idle}


def cpu_costs(fleet: dict[str, Any]) -> CpuCosts:
    """The costs from one bench/fleet.py run's totals (a run that did not record its agents one by
    one): its agents' CPU while they transferred. Without peers every node takes the model from the
    origin: that run's CPU over its bytes is the cost of a byte taken in (the agents' idle work in
    the meantime, status writes and watches, included). With peers every node takes the model in
    and the peers send ``peer_bytes_p2p``: what that run used beyond the bytes taken in, over the
    bytes sent, is a peer byte's extra (TLS both ends, the server's reads, the polls)."""
    nodes, model = int(fleet["nodes"]), int(fleet["model_bytes"])
    pull = float(fleet["agent_cpu_seconds_direct"]) / (nodes * model)
    beyond = max(0.0, float(fleet["agent_cpu_seconds_p2p"]) - pull * nodes * model)
    return CpuCosts(pull, beyond / max(1, int(fleet["peer_bytes_p2p"])))


def contention(fleets: list[dict[str, Any]]) -> float | None:
    """How many times what their work costs on a quiet machine these bench/fleet.py runs' agents
    paid (with peers): their CPU over their bytes taken in, bytes sent and polls answered at
    the quiet costs (CPU_IN_PER_GIB, CPU_SENT_PER_GIB, CPU_POLL_PER_1000). Measured, 2 December:
    9.4x (fleet-8-stop38.json, load 11-28), 7.6x (fleet-16-stop38.json, load 5-29), 7.0x and
    6.8x (the -probed runs, load 19-31): 15-51 runnable agent threads on 2 cores pay for the
    GIL's hand-offs and cold caches what a quiet agent does not. None: no agents recorded."""
    cpu = quiet = 0.0
    for fleet in fleets:
        for agent in (fleet.get("agents_p2p") or {}).values():
            taken = float(agent.get("from_peers") or 0) + float(agent.get("from_origin") or 0)
            quiet += (taken * CPU_IN_PER_GIB + float(agent["sent_bytes"]) * CPU_SENT_PER_GIB) / (1 << 30)
            quiet += float(agent["polls_answered"]) * CPU_POLL_PER_1000 / 1000
            cpu += float(agent["cpu_seconds"])
    return cpu / quiet if quiet > 0 else None


def idle_cores(fleets: list[dict[str, Any]]) -> float:
    """An agent's cores once the model is everywhere (bench/fleet.py's idle_cpu_seconds_per_minute,
    the mean over the runs' agents with peers): watches, status writes."""
    idle = [float(a["idle_cpu_seconds_per_minute"]) / 60 for fleet in fleets
            for a in (fleet.get("agents_p2p") or {}).values() if a.get("idle_cpu_seconds_per_minute") is not None]
    return sum(idle) / len(idle) if idle else 0.0


def costs_of(fleets: list[dict[str, Any]]) -> CpuCosts | None:
    """The CPU costs on the machine of these bench/fleet.py runs: the quiet costs times what their
    agents paid over them (``contention``), each agent's idle cores as measured (``idle_cores``);
    else the totals of the first that has a run without peers (``cpu_costs``: an older run)."""
    factor = contention(fleets)
    if factor is not None:
        gib = 1 << 30
        return CpuCosts(pull=CPU_IN_PER_GIB * factor / gib, serve=CPU_SENT_PER_GIB * factor / gib,
                        poll=CPU_POLL_PER_1000 * factor / 1000, idle=idle_cores(fleets))
    for fleet in fleets:
        if {"agent_cpu_seconds_direct", "agent_cpu_seconds_p2p", "peer_bytes_p2p"} <= set(fleet):
            return cpu_costs(fleet)
    return None


def others_over_time(fleet: dict[str, Any], mode: str) -> tuple[tuple[float, float], ...]:
    """The other processes' runnable threads during a run, from bench/fleet.py's probe repeated
    during it: [seconds, a core's share s, the agents' runnable threads a] gives ``cpus / s - 1
    - a`` (the scheduler's fair share per runnable thread: what the probe got beside the agents'
    threads it saw runnable)."""
    cpus = float(fleet.get("cpus") or os.cpu_count() or 1)
    return tuple((float(t), max(0.0, cpus / max(s, 1e-3) - 1 - a))
                 for t, s, a in fleet.get(f"cpu_share_during_{mode}") or ())


#: Seconds between the simulation's samples of the cores its agents use, in a validation whose run
#: recorded its agents' CPU per probe window (a 2 s window: 40 samples).
TRACE_EVERY = 0.05


def trace_times(fleet: dict[str, Any], mode: str = "p2p") -> tuple[float, ...]:
    """When to sample the simulated agents' cores: every TRACE_EVERY s over the run's probe windows."""
    at = (fleet.get(f"agents_during_{mode}") or {}).get("at") or []
    if not at:
        return ()
    first, last = float(at[0][0]), float(at[-1][1])
    return tuple(round(first + i * TRACE_EVERY, 3) for i in range(int((last - first) / TRACE_EVERY) + 1))


def cpu_per_window(fleet: dict[str, Any], world: World, mode: str = "p2p",
                   trace: list[tuple[float, float]] | None = None) -> dict[str, Any] | None:
    """The agents' own cores in each of the probe's windows (bench/fleet.py's ``agents_during``)
    next to what the model offers each agent then: ``Machine.cores`` with every agent at work
    beside the others of that sample (``others_over_time``), idle use included (the agents' CPU
    includes theirs). ``used_probe_window``: an agent's mean cores over the probe's own second;
    ``used_to_next``: from this sample's start to the next one's, the step over which the
    simulation holds that sample's others; ``simulated``: with ``trace`` (``simulate``'s samples of
    its agents' cores), an agent's mean cores in the simulation over that same step (while it ran;
    samples ``TRACE_EVERY`` apart). ``total``:
    CPU-s over the run's samples, offered (step by step) against used (and simulated). None: a run
    recorded before the series (the agents' totals only)."""
    during = fleet.get(f"agents_during_{mode}") or {}
    cpu: dict[str, list[list[float]]] = during.get("cpu_seconds") or {}
    at: list[list[float]] = during.get("at") or []
    samples = fleet.get(f"cpu_share_during_{mode}") or []
    if not cpu or not at or not samples:
        return None
    agents = len(cpu)
    cores = world.cpus if world.cpus > 0 else float(fleet.get("cpus") or os.cpu_count() or 1)
    gil = world.gil if world.gil > 0 else math.inf
    windows, offered_cpu, used_cpu, simulated_cpu = [], 0.0, 0.0, 0.0
    count = min(len(at), len(samples))
    for i, ((_, share, runnable), (start, end), (_, others)) in enumerate(
            zip(samples, at, others_over_time(fleet, mode), strict=False)):
        offered = Machine(None, cores, others, gil, 0.0).cores(agents)  # type: ignore[arg-type]
        used = sum(rows[i][1] - rows[i][0] for rows in cpu.values()) / max(1e-9, end - start) / agents
        to_next = None
        if i + 1 < count:
            until = at[i + 1][0]
            spent = sum(rows[i + 1][0] - rows[i][0] for rows in cpu.values())
            to_next = spent / max(1e-9, until - start) / agents
            used_cpu += spent
        else:  # the last sample: its own window
            until = end
            used_cpu += used * agents * (end - start)
        offered_cpu += offered * agents * (until - start)
        row = {"t": start, "probe_share": share, "agents_runnable": runnable, "others": round(others, 2),
               "offered": round(offered, 3), "used_probe_window": round(used, 3),
               "used_to_next": None if to_next is None else round(to_next, 3),
               "used_over_offered": round(used / offered, 2) if offered > 0 else None}
        if trace is not None:
            # None: the simulated swarm had finished (it samples only while it runs).
            points = [c for t, c in trace if start <= t < until]
            simulated = sum(points) / len(points) / agents if points else None
            simulated_cpu += (simulated or 0.0) * agents * min(until - start, len(points) * TRACE_EVERY)
            row["simulated"] = None if simulated is None else round(simulated, 3)
        windows.append(row)
    total: dict[str, Any] = {"offered_cpu_seconds": round(offered_cpu, 2), "used_cpu_seconds": round(used_cpu, 2),
                             "used_over_offered": round(used_cpu / offered_cpu, 3) if offered_cpu > 0 else None}
    if trace is not None:
        total["simulated_cpu_seconds"] = round(simulated_cpu, 2)
    return {"agents": agents, "windows": windows, "total": total}


def print_cpu_windows(check: dict[str, Any], out: Any = sys.stderr) -> None:
    """``cpu_per_window`` of one validated run as a table (cores per agent)."""
    windows = check.get("cpu_per_window")
    if not windows:
        return
    total = windows["total"]
    simulated = total.get("simulated_cpu_seconds")
    print(f"{check['nodes']} nodes: each agent's cores per probe window, used (bench/fleet.py) against the model's "
          f"offer; in all {total['used_cpu_seconds']} of {total['offered_cpu_seconds']} CPU-s offered "
          f"({total['used_over_offered']}x)" + ("" if simulated is None else f", {simulated} used simulated"),
          file=out)
    print("| s | probe's share | agents runnable | others | offered | used (probe's window) | used (to the next) "
          "| used / offered | simulated (to the next) |", file=out)
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|", file=out)
    for w in windows["windows"]:
        to_next = "-" if w["used_to_next"] is None else w["used_to_next"]
        simulated_here = "-" if w.get("simulated") is None else w["simulated"]
        print(f"| {w['t']} | {w['probe_share']} | {w['agents_runnable']} | {w['others']} | {w['offered']} | "
              f"{w['used_probe_window']} | {to_next} | {w['used_over_offered']} | {simulated_here} |",
              file=out)


def fleet_world(fleet: dict[str, Any], base: World, cpu: CpuCosts | None = None, mode: str = "p2p") -> World:
    """bench/fleet.py's world for one of its runs (``mode``: p2p, or single: one node without
    peers): its nodes in one zone, its model (a config and four shards), its origin throttled to
    ``origin_rate`` in all (a local moto: no cap per connection), the agent's --chunk-size there
    (16 MiB, bench/fleet.AGENT_FLAGS), and its agents on one machine's cores (``cpus``) with the
    other processes its probe measured during that run (``others_over_time``; a run that probed
    only before: the share of a core then, ``cpu_share_p2p``) at the costs ``cpu`` (default:
    those of the run itself, ``costs_of``; no CPU model when it did not record them)."""
    if cpu is None and "cpu_share_p2p" in fleet:
        cpu = costs_of([fleet])
    machine: dict[str, Any] = {"cpus": 0.0}
    if cpu is not None:
        machine = {"cpus": float(fleet.get("cpus") or os.cpu_count() or 1), "cpu_shared": True,
                   "cpu_share": float(fleet.get(f"cpu_share_{mode}") or fleet["cpu_share_p2p"]),
                   "cpu_others": others_over_time(fleet, mode), **cpu.world()}
    single = mode == "single"
    return World(**{**base.__dict__, "nodes": 1 if single else int(fleet["nodes"]), "zones": 1, "peers": not single,
                    "files": model_sizes(int(fleet["model_bytes"]), 4), "origin_total": float(fleet["origin_rate"]),
                    "origin_zone": math.inf, "origin_stream": math.inf, "chunk_size": 16 * MiB, **machine})


def validate(fleet: dict[str, Any], base: World, cpu: CpuCosts | None = None) -> dict[str, Any]:
    """Simulate bench/fleet.py's run (with peers, and one node alone, each under the load its
    probe measured) and compare both figures with what its real agents did."""
    world = fleet_world(fleet, base, cpu)
    alone = fleet_world(fleet, base, cpu, "single") if fleet.get("cpu_share_during_single") else None
    world = World(**{**world.__dict__, "cpu_trace": trace_times(fleet)}) if world.cpus > 0 else world
    sim = scenario(world, alone)
    real = {"time_vs_single": fleet["seconds_p2p"] / fleet["seconds_single"],
            "origin_vs_model": fleet["origin_bytes_p2p"] / fleet["model_bytes"]}
    simulated = {"time_vs_single": sim["time_vs_single"], "origin_vs_model": sim["origin_per_zone_vs_model"]}
    error = {k: round(abs(simulated[k] / real[k] - 1), 3) for k in real}
    agents = fleet.get("agents_p2p") or {}
    polls = {"fleet": sum(a["polls_answered"] for a in agents.values()) if agents else None,
             "simulated": sim["polls_answered"]}
    return {"nodes": fleet["nodes"], "fleet": {k: round(v, 3) for k, v in real.items()}, "simulated": simulated,
            "polls_answered": polls,
            "peer_events": {"fleet": fleet.get("peer_events_p2p"), "simulated": sim["peer_events"]},
            "seconds": {"simulated": sim["seconds"], "simulated_single": sim["seconds_single"]},
            "cpu_model": cpu_model(world), "contention": round(contention([fleet]) or 0.0, 2) or None,
            "cpu_per_window": cpu_per_window(fleet, world, trace=sim["cpu_trace"] if world.cpu_trace else None),
            "relative_error": error, "within": TOLERANCE, "ok": all(e <= TOLERANCE for e in error.values())}


def main() -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":
        # Sets of names are iterated by the decision code: with str hashing randomised per process
        # the same world would give another result each run.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    # Millions of small objects live for the whole run (pieces heard, events): the collector's
    # default thresholds scan them over and over (60 nodes: 40.6 CPU-s by default, 24.2 with these).
    gc.set_threshold(200_000, 50, 50)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--zones", type=int, default=1)
    ap.add_argument("--size", default="2Gi", help="model size")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--origin-stream", default="100M", help="origin bytes/s per connection (S3: ~100 MB/s)")
    ap.add_argument("--origin-zone", default="0", help="origin bytes/s per zone (0: no limit)")
    ap.add_argument("--origin-total", default="0", help="origin bytes/s in all (0: no limit)")
    ap.add_argument("--nic", default="3125M", help="bytes/s per node and direction (25 Gbit/s)")
    ap.add_argument("--inter-zone", default="0", help="bytes/s per pair of zones (0: no limit)")
    ap.add_argument("--latency", type=float, default=0.0005)
    ap.add_argument("--inter-zone-latency", type=float, default=0.002)
    ap.add_argument("--cpus", type=float, default=NODE_CPUS,
                    help="cores per node (default: deploy/'s agent limit), in all with --cpus-shared; 0: no CPU model")
    ap.add_argument("--cpus-shared", action="store_true",
                    help="every node's agent on one machine's --cpus cores (as bench/fleet.py's run)")
    ap.add_argument("--cpu-share", type=float, default=0.0,
                    help="with --cpus-shared: the share of a core one more process gets (bench/fleet.py's probe)")
    ap.add_argument("--cpu-in", type=float, default=CPU_IN_PER_GIB, help="CPU-s per GiB a node takes in")
    ap.add_argument("--cpu-sent", type=float, default=CPU_SENT_PER_GIB, help="CPU-s per GiB a node sends to a peer")
    ap.add_argument("--cpu-poll", type=float, default=CPU_POLL_PER_1000,
                    help="CPU-s per 1,000 long polls answered (both ends)")
    ap.add_argument("--cpu-idle", type=float, default=CPU_IDLE_CORES,
                    help="cores an agent uses whatever it transfers")
    ap.add_argument("--gil", type=float, default=GIL_CORES,
                    help="cores an agent can use at most (its Python: one thread at a time); 0: no bound")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu-costs", type=Path, nargs="+", help="bench/fleet.py --json outputs whose agents give the "
                    "validation its CPU costs (default: each validated run its own)")
    ap.add_argument("--validate", type=Path, nargs="+", default=list(FLEET_RESULTS),
                    help="bench/fleet.py --json outputs to validate against (default: %(default)s; 'none': skip)")
    args = ap.parse_args()

    def rate(value: str) -> float:
        n = parse_size(value)
        return float(n) if n > 0 else math.inf

    world = World(nodes=args.nodes, zones=args.zones, files=model_sizes(parse_size(args.size), args.shards),
                  workers=args.workers, origin_stream=rate(args.origin_stream), origin_zone=rate(args.origin_zone),
                  origin_total=rate(args.origin_total), nic=rate(args.nic), inter_zone=rate(args.inter_zone),
                  latency=args.latency, inter_zone_latency=args.inter_zone_latency, seed=args.seed,
                  cpus=args.cpus, cpu_shared=args.cpus_shared, cpu_share=args.cpu_share,
                  cpu_pull=args.cpu_in / (1 << 30), cpu_serve=args.cpu_sent / (1 << 30),
                  cpu_poll=args.cpu_poll / 1000, cpu_idle=args.cpu_idle, gil=args.gil)
    out = scenario(world)
    out["validated_against_fleet"] = None
    if [str(p) for p in args.validate] != ["none"]:
        for path in [*args.validate, *(args.cpu_costs or ())]:
            if not path.is_file():
                ap.error(f"{path}: no such file (bench/fleet.py --nodes 8 --json FILE writes one)")
        fleets = [json.loads(path.read_text()) for path in args.validate]
        costs = costs_of([json.loads(path.read_text()) for path in args.cpu_costs]) if args.cpu_costs else None
        out["validation"] = [validate(fleet, world, costs) for fleet in fleets]
        for check in out["validation"]:
            print_cpu_windows(check)
        out["validated_against_fleet"] = all(check["ok"] for check in out["validation"])
    out["load_average"] = round(os.getloadavg()[0], 1)
    text = json.dumps(out)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
