"""How a node's swarm behaves: its waits, polls, caps and deadlines (``SwarmSettings``), read by
the plan (plan.py), the session (swarm.py) and bench/swarm_sim.py alike."""

from __future__ import annotations

from dataclasses import dataclass


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
    #: Consecutive pieces owned by one member, at most (read from the origin in one request, a
    #: response's first byte paid once): a file is cut into 8 blocks or more, each at most this
    #: many pieces (bench/swarm_sim.py, 8 nodes, 2 GiB, S3-like origin: 1.63x one node's time
    #: with single pieces, 1.03x with blocks of 16).
    block: int = 166
    #: How often the directory is asked who the peers are.
    refresh: float = 0.5
    #: The engine's stall timeout: a piece waits for peers at most half of it (``budget``).
    stall_timeout: float = 30.0
    #: A peer read is given ``max(piece_min_time, bytes / min_peer_rate)`` seconds: a 4 MiB
    #: piece 5 s, so a peer slower than ~800 KiB/s per stream gives way (the origin or another
    #: holder is then faster), while a loaded node (TLS on a busy CPU) is not cut.
    min_peer_rate: float = float(1 << 20)
    piece_min_time: float = 5.0
    #: Nodes that must have read a piece from the origin, and agree on its sha-256, before its
    #: bytes are taken from a peer, for a file whose source gives no checksum that settles it (an
    #: unforgeable one). 1 trusts any one node's word; 2 (the default) holds against one lying node
    #: at the cost of reading such files twice from the origin in a group.
    witnesses: int = 2

    @property
    def budget(self) -> float:
        """How long a piece may wait for peers before it is read from the origin."""
        return max(0.0, min(self.wait, self.stall_timeout / 2))

    def read_deadline(self, now: float, started: float, size: int) -> float:
        """When a read of ``size`` bytes from a peer, begun ``now`` for a piece first asked for
        at ``started``, is given up: slow peers give way, and never past 0.8 of the stall
        timeout after the piece was first asked for (the origin then still has the rest)."""
        return min(now + max(self.piece_min_time, size / max(1.0, self.min_peer_rate)), self.stall_bound(started))

    def stall_bound(self, started: float) -> float:
        """No wait for a peer, nor a peer read, for a piece first asked for at ``started`` goes past
        this: 0.8 of the stall timeout (the origin then still has the rest before the watchdog)."""
        return started + self.stall_timeout * 0.8
