"""A peer server under a flood of slow unauthenticated connections: what it costs the node, and
whether an honest agent is still served at its normal rate.

In one process: a seed node (PeerNetwork + PeerServer over real TLS, tests/peer_util.py) that
holds a model of ``--size`` bytes. Two pulls of the model by a fresh node that reads every byte
from the seed, side by side in one run: one with the port quiet, one while another process
(tests/peer_flood.py) holds ``--connections`` half-sent requests from ``--sources`` addresses.
Prints the seed process's threads and RSS before and under the flood, the two pull times, and
their ratio (flood / quiet).

    .venv/bin/python bench/peer_flood.py [--size 256Mi] [--connections 1000] [--sources 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modelcache.sizes import parse_size  # noqa: E402
from modelcache.uri import storage_key  # noqa: E402
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
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    size = parse_size(args.size)
    with tempfile.TemporaryDirectory(prefix="peer-flood-") as tmp:
        folder = Path(tmp)
        files = make_source(folder / "src", {f"model-{i}.safetensors": size // 4 for i in range(4)})
        uri = f"file://{folder / 'src'}"
        made = node_factory(folder)
        make = next(made)
        seed = make("seed", witnesses=1)
        pull_all([seed], uri, workers=8)

        def pull(name: str) -> float:
            node = make(name, witnesses=1)
            started = time.monotonic()
            pull_all([node], uri, workers=8)
            took = time.monotonic() - started
            check(node, uri, files)
            stats = node.network.stats(storage_key(uri))
            assert stats is not None and stats.from_origin == 0, stats
            return took

        quiet = pull("quiet")
        threads, before = threading.active_count(), rss()
        proc = subprocess.Popen([sys.executable, "-m", "tests.peer_flood", "127.0.0.1", str(seed.server.port),
                                 str(args.connections), str(args.sources), "head"], stdout=subprocess.PIPE,
                                text=True, cwd=REPO)
        try:
            assert proc.stdout is not None
            proc.stdout.readline()  # opened N
            under_threads, under_rss = threading.active_count() - threads, rss() - before
            flood = pull("flood")
            alive = int(proc.stdout.readline().split()[1])
        finally:
            proc.kill()
            proc.wait()
        next(made, None)
    result = {"size": size, "connections": args.connections, "sources": args.sources,
              "extra_threads": under_threads, "extra_rss_mib": round(under_rss / 2**20, 1), "flood_alive": alive,
              "quiet_s": round(quiet, 2), "flood_s": round(flood, 2), "ratio": round(flood / quiet, 2)}
    print(f"seed under {args.connections} slow connections from {args.sources} addresses: +{under_threads} threads, "
          f"+{result['extra_rss_mib']} MiB RSS, {alive} connections open")
    print(f"honest pull of {args.size} from the seed: quiet {quiet:.2f}s, under the flood {flood:.2f}s "
          f"(ratio {flood / quiet:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
