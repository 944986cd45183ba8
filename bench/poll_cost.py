"""The CPU one long poll costs, both ends: a real PeerServer (TLS, the token check, the reply's
JSON) answering a real PeerClient's ``have`` in one process, the reply taken into a Plan as a
SwarmSession does. Each reply carries ``--pieces`` new pieces (what a poll brings while a group
downloads: a few pieces at a time). CPU-s over polls is what bench/swarm_sim.py charges per poll
answered on a node with cores of its own (its fleet default): CPU time, not wall time, so the
machine's load changes it little.

    .venv/bin/python bench/poll_cost.py [--polls 2000] [--pieces 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from coordinator.certs import generate_self_signed  # noqa: E402
from modelcache.peers.client import PeerClient, PeerInfo  # noqa: E402
from modelcache.peers.plan import PeerState, Plan  # noqa: E402
from modelcache.peers.protocol import Geometry, HaveReply  # noqa: E402
from modelcache.peers.server import OK, PeerServer, ServedRange, cert_fingerprint, server_context  # noqa: E402
from modelcache.peers.settings import SwarmSettings  # noqa: E402

TOKEN = "poll-cost"
PIECES = 4096


class Growing:
    """A catalog whose model gains ``per_poll`` pieces before each answer (never waits)."""

    def __init__(self, per_poll: int) -> None:
        self.per_poll = per_poll
        self.served: list[tuple[int, int, str, bool]] = []

    def have(self, key: str, digest: str, epoch: str, since: int, wait: float) -> HaveReply | None:
        for _ in range(self.per_poll):
            n = len(self.served) % PIECES
            self.served.append((0, n, f"{n:064x}", n % 2 == 0))
        full = epoch != "e" or not 0 <= since <= len(self.served)
        pieces = self.served if full else self.served[since:]
        return HaveReply("e", len(self.served), 4 << 20, False, full, list(pieces)[-PIECES:], [])

    def range(self, key: str, digest: str, ci: int, start: int, end: int) -> ServedRange | None:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--polls", type=int, default=2000)
    ap.add_argument("--pieces", type=int, default=4, help="new pieces per reply")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="poll-cost-"))
    cert, key = generate_self_signed(folder, ["127.0.0.1"])
    server = PeerServer("127.0.0.1", 0, server_context(str(cert), str(key)), Growing(args.pieces),
                        lambda token: OK).start()
    client = PeerClient(lambda: TOKEN)
    info = PeerInfo("peer", "127.0.0.1", server.port, cert_fingerprint(cert.read_text()))
    geometry = Geometry(4 << 20, (PIECES,))
    plan = Plan(SwarmSettings(node="me"), "model", files=1, counts=(PIECES,))
    state = PeerState("peer")
    plan.add(state)
    try:
        seq = 0
        for _ in range(20):  # the connection and TLS session made, caches warm
            seq = client.have(info, "0" * 16, "d" * 32, geometry, "e", seq, 0.0).seq
        cpu, wall = time.process_time(), time.monotonic()
        for _ in range(args.polls):
            reply = client.have(info, "0" * 16, "d" * 32, geometry, "e", seq, 0.0)
            seq = reply.seq
            plan.heard(state, reply.full, reply.pieces, reply.fetching, reply.complete)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        server.stop()
        client.close()
    out = {"polls": args.polls, "pieces_per_reply": args.pieces, "cpu_seconds": round(cpu, 3),
           "cpu_s_per_1000_polls": round(cpu / args.polls * 1000, 3), "wall_seconds": round(wall, 2),
           "load_average": [round(x, 1) for x in os.getloadavg()]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
