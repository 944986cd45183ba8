"""The ring that gives each block of a model its owners in a swarm: consistent hashing over the
members still downloading, so that every node that knows the same members computes the same owners.
Pure: no I/O, no clock (``plan.py`` asks it; ``bench/swarm_sim.py`` drives the same code).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Collection

#: Points per member on the ring (bisect per lookup; 16 keep the largest share within ~1.5x the mean).
RING_POINTS = 16
_POINTS: dict[str, list[tuple[int, str]]] = {}


def h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Ring:
    """Consistent hashing of the swarm's blocks onto its members: every node that knows the same
    members computes the same owners, and one member more or less moves only its own blocks
    (two nodes whose views differ by a member disagree about 1/members of the blocks)."""

    def __init__(self, members: frozenset[str]) -> None:
        points: list[tuple[int, str]] = []
        for name in members:
            mine = _POINTS.get(name)
            if mine is None:
                mine = _POINTS[name] = [(h64(f"{name}\0{v}"), name) for v in range(RING_POINTS)]
                if len(_POINTS) > 65536:  # names of nodes long gone
                    _POINTS.clear()
            points += mine
        points.sort()
        self.hashes = [h for h, _ in points]
        self.names = [n for _, n in points]
        self.size = len(members)

    def owners(self, point: int, count: int, skip: Collection[str] = ()) -> list[str]:
        """The first ``count`` members clockwise from ``point``, less ``skip``."""
        out: list[str] = []
        if not self.names:
            return out
        start = bisect.bisect_left(self.hashes, point)
        for i in range(len(self.names)):
            name = self.names[(start + i) % len(self.names)]
            if name not in out and name not in skip:
                out.append(name)
                if len(out) >= count or len(out) + len(skip) >= self.size:
                    break
        return out
