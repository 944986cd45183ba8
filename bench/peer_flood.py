"""A peer server under a flood of slow unauthenticated connections: what it costs the node, and
whether an honest agent is still served at its normal rate.

In one process: a seed node (PeerNetwork + PeerServer over real TLS, tests/peer_util.py) that
holds a model of ``--size`` bytes. Two pulls of the model by a fresh node that reads every byte
from the seed, side by side in one run: one with the port quiet, one while another process
(tests/peer_flood.py) holds ``--connections`` half-sent requests from ``--sources`` addresses.
``--rounds`` times each, alternating (a fresh flood each round). Prints the seed process's extra
threads and RSS under the flood, the pull times, and the ratio of their medians (flood / quiet).

    .venv/bin/python bench/peer_flood.py [--size 256Mi] [--connections 1000] [--sources 10] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modelcache.runtime.sizes import parse_size  # noqa: E402
from modelcache.sources.uri import storage_key  # noqa: E402
from tests.peer_util import check, make_source, node_factory, pull_all  # noqa: E402


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256Mi")
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--sources", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5,
                    help="quiet and flooded pulls, alternating (a pull of a few seconds on a shared machine "
                         "varies by 2x from one to the next: the medians are compared)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    size = parse_size(args.size)
    quiet: list[float] = []
    flooded: list[float] = []
    threads_up = rss_up = alive = 0
    with tempfile.TemporaryDirectory(prefix="peer-flood-") as tmp:
        folder = Path(tmp)
        files = make_source(folder / "src", {f"model-{i}.safetensors": size // 4 for i in range(4)})
        uri = f"file://{folder / 'src'}"
        made = node_factory(folder)
        make = next(made)
        seed = make("seed", witnesses=1)
        pull_all([seed], uri, workers=8)
        from_origin: dict[str, int] = {}

        def pull(name: str) -> float:
            # The agent's formation window (3 s): a seed heard later than that leaves the first
            # pieces to the origin (here a local folder, faster than any peer).
            node = make(name, witnesses=1, formation=3.0)
            started = time.monotonic()
            pull_all([node], uri, workers=8)
            took = time.monotonic() - started
            check(node, uri, files)
            stats = node.network.stats(storage_key(uri))
            assert stats is not None
            if stats.from_origin:  # not served by the seed (in time): said, not hidden
                from_origin[name] = stats.from_origin
            shutil.rmtree(node.root)  # its copy is checked: the disk holds one model per pull at most
            return took

        for r in range(args.rounds):
            quiet.append(pull(f"quiet-{r}"))
            threads, before = threading.active_count(), rss()
            # A fresh flood per round: its connections are cut at the server's 10 s head deadline.
            proc = subprocess.Popen([sys.executable, "-m", "tests.peer_flood", "127.0.0.1", str(seed.server.port),
                                     str(args.connections), str(args.sources), "head"], stdout=subprocess.PIPE,
                                    text=True, cwd=REPO)
            try:
                assert proc.stdout is not None
                proc.stdout.readline()  # opened N
                threads_up = max(threads_up, threading.active_count() - threads)
                rss_up = max(rss_up, rss() - before)
                flooded.append(pull(f"flood-{r}"))
                alive = max(alive, int(proc.stdout.readline().split()[1]))
            finally:
                proc.kill()
                proc.wait()
        next(made, None)
    q, f = statistics.median(quiet), statistics.median(flooded)
    load = os.getloadavg()
    result = {"size": size, "connections": args.connections, "sources": args.sources, "rounds": args.rounds,
              "extra_threads": threads_up, "extra_rss_mib": round(rss_up / 2**20, 1), "flood_alive": alive,
              "quiet_s": [round(x, 2) for x in quiet], "flood_s": [round(x, 2) for x in flooded],
              "ratio": round(f / q, 2), "load_average": [round(x, 1) for x in load], "from_origin": from_origin}
    print(f"seed under {args.connections} slow connections from {args.sources} addresses: +{threads_up} threads, "
          f"+{result['extra_rss_mib']} MiB RSS at most, {alive} connections open")
    print(f"honest pull of {args.size} from the seed, {args.rounds} rounds: quiet median {q:.2f}s, under the flood "
          f"median {f:.2f}s (ratio {f / q:.2f}); load average {load[0]:.1f}"
          + (f"; pulls that read the origin: {from_origin}" if from_origin else "; every byte from the seed"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
