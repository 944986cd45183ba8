"""`python -m tests.kubeapi --port PORT --crds deploy/crds [--crds more]`: serve until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from tests.kubeapi.app import make_server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.kubeapi", description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--crds", action="append", type=Path, default=[], help="directory of CRD manifests (repeatable)")
    ap.add_argument("--history", type=int, default=1000, help="watch events kept; older versions get 410 Gone")
    ap.add_argument("--bookmark-interval", type=float, default=5.0, help="seconds between watch BOOKMARKs")
    ap.add_argument("--verbose", action="store_true", help="log every request to stderr")
    args = ap.parse_args(argv)
    server = make_server(args.host, args.port, args.crds, args.history, args.bookmark_interval, args.verbose)

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"kubeapi: serving on http://{args.host}:{server.server_address[1]}", file=sys.stderr, flush=True)
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
