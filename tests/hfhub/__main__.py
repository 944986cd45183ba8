"""Run the test Hub by hand: ``python -m tests.hfhub --repo org/name=DIR [--token T] [--port P]``.

Each DIR is committed as the ``main`` branch of its repo (files of at least --lfs-threshold
bytes become LFS). Point clients at it with ``HF_ENDPOINT=<printed url>``.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

from tests.hfhub.server import HubServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repo", action="append", default=[], metavar="ORG/NAME=DIR", help="serve DIR as a repo")
    ap.add_argument("--token", action="append", default=[], help="a valid token (repeatable)")
    ap.add_argument("--private", action="store_true", help="repos readable only with a --token")
    ap.add_argument("--lfs-threshold", type=int, default=64 * 1024)
    args = ap.parse_args()
    hub = HubServer(lfs_threshold=args.lfs_threshold, tokens=set(args.token))
    for spec in args.repo:
        repo_id, _, folder = spec.partition("=")
        root = Path(folder)
        files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        repo = hub.create_repo(repo_id, private=args.private)
        repo.allowed_tokens.update(args.token)
        repo.commit(files, message=f"import {root}")
    hub.start()
    print(f"HF_ENDPOINT={hub.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        hub.stop()


if __name__ == "__main__":
    main()
