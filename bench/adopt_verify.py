#!/usr/bin/env python3
"""Benchmark: verify a KServe-filled model folder in place (the switch-over's adoption), per TiB.

After the switch every ``models/<storageKey>/`` KServe's agent filled is verified in place:
listed, and each file hashed on disk against the source's checksum (plus the store's own xxh3),
while the node keeps counting it as downloaded (docs/kserve-compat.md). How long that takes is
what an operator plans the switch around. This measures it: N shards of random bytes, served by
nginx with their checksum in a header (``Repr-Digest: sha-256`` as the Hub's LFS files and
RFC 9530 servers carry it; ``Content-MD5`` as S3's ETags are), laid out as KServe's download Job
leaves them, and adopted with ``modelcache.pull(..., adoption=AS_FOUND)`` as the agent does. The
peers, run side by side on the same files each round, are coreutils (``sha256sum`` / ``md5sum``)
and ``openssl dgst``: the plain cost of reading and hashing them once.

Each run starts with the files out of the page cache (``posix_fadvise(DONTNEED)`` on these files
only, not the machine's cache), so the disk is read as on a node. The script prints seconds,
MB/s (1 MB = 10^6 bytes), CPU seconds per GiB, the ratio to the peer, and the time per TiB
extrapolated for a node verifying ``--concurrency`` models at once (the agent's
``--max-concurrent-models``, 2 by default) when hashing, not the disk, is the limit.

    .venv/bin/python bench/adopt_verify.py                      # 4 GiB, 3 rounds
    .venv/bin/python bench/adopt_verify.py --size 512MiB --rounds 1
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modelcache.adopt import AS_FOUND  # noqa: E402
from modelcache.pull import pull  # noqa: E402
from modelcache.runtime import sizes  # noqa: E402  (needs the repo on sys.path)
from modelcache.sources.credentials import Settings  # noqa: E402
from modelcache.sources.uri import storage_key  # noqa: E402
from tests.fixtures.http import NginxServer, make_tls  # noqa: E402
from tests.helpers import free_port  # noqa: E402

TIB = 1 << 40
GIB = 1 << 30
#: The checksum header each run serves, and the peers that compute the same digest of the same
#: files: coreutils, and OpenSSL (whose SHA-256 uses the CPU's SHA extensions where it has them,
#: as Python's hashlib does; coreutils' does not).
ALGOS = {
    "sha256": (lambda d: {"Repr-Digest": f"sha-256=:{base64.b64encode(d.digest()).decode()}:"},
               {"sha256sum": ["sha256sum"], "openssl": ["openssl", "dgst", "-sha256"]}),
    "md5": (lambda d: {"Content-MD5": base64.b64encode(d.digest()).decode()},
            {"md5sum": ["md5sum"], "openssl": ["openssl", "dgst", "-md5"]}),
}


@dataclass
class Run:
    tool: str
    algo: str
    seconds: float
    cpu: float
    bytes: int


def make_shards(folder: Path, total: int, shards: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    each = total // shards
    paths = []
    for i in range(shards):
        p = folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        with open(p, "wb") as f:
            left = each
            while left:
                n = min(left, 64 << 20)
                f.write(os.urandom(n))
                left -= n
        paths.append(p)
    return paths


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_modelcache(uri: str, root: Path, files: list[Path], algo: str) -> Run:
    shutil.rmtree(root / ".modelcache", ignore_errors=True)  # not adopted yet: as KServe left it
    drop_cache(files)
    settings = Settings.from_env({})
    t0, c0 = time.monotonic(), time.process_time()
    result = pull(uri, root=root, settings=settings, adoption=AS_FOUND)
    seconds, cpu = time.monotonic() - t0, time.process_time() - c0
    assert result.adopted == len(files) and not result.kept_as_found, result
    assert result.verified == (algo,), result.verified
    return Run("modelcache", algo, seconds, cpu, sum(p.stat().st_size for p in files))


def run_peer(tool: str, argv: list[str], files: list[Path], algo: str) -> Run:
    drop_cache(files)
    t0, c0 = time.monotonic(), child_cpu()
    subprocess.run([*argv, *map(str, files)], check=True, stdout=subprocess.DEVNULL)
    return Run(tool, algo, time.monotonic() - t0, child_cpu() - c0, sum(p.stat().st_size for p in files))


def report(runs: list[Run], concurrency: int, load: str) -> str:
    """Medians per tool; ``ratio`` is modelcache's time over each peer's (below 1: faster)."""
    lines = [f"load before: {load}", "",
             f"{'algo':7} {'tool':11} {'median s':>9} {'MB/s':>8} {'CPU s/GiB':>10} {'mc/tool':>8} "
             f"{'per TiB, 1 model':>17} {f'per TiB, {concurrency} at once':>20}"]
    for algo, (_header, peers) in ALGOS.items():
        by_tool = {t: [r for r in runs if r.tool == t and r.algo == algo] for t in ("modelcache", *peers)}
        med = {t: statistics.median(r.seconds for r in rs) for t, rs in by_tool.items() if rs}
        for tool, rs in by_tool.items():
            if not rs:
                continue
            size = rs[0].bytes
            sec = med[tool]
            cpu_gib = statistics.median(r.cpu for r in rs) / (size / GIB)
            per_tib = sec / size * TIB
            # N models at once on N cores, each hashing on one: bounded by hashing, or by the disk
            # (the single-model run's rate is a lower bound of what the disk gives).
            parallel = max(per_tib / concurrency, cpu_gib * 1024 / concurrency)
            ratio = med["modelcache"] / sec if "modelcache" in med else float("nan")
            lines.append(f"{algo:7} {tool:11} {sec:9.2f} {size / sec / 1e6:8.0f} {cpu_gib:10.2f} {ratio:8.2f} "
                         f"{per_tib / 60:14.1f} min {parallel / 60:17.1f} min")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=sizes.parse_size, default=4 * GIB, help="total bytes (default 4GiB)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=2, help="models verified at once on a node (default 2)")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    work = Path(tempfile.mkdtemp(prefix="adopt-verify-", dir=args.workdir))
    server = None
    try:
        data = work / "data"
        print(f"preparing {args.size / GIB:.2f} GiB in {data} ...", flush=True)
        shards = make_shards(data, args.size, args.shards)
        nginx_dir = work / "nginx"
        server = NginxServer(binary=shutil.which("nginx", path="/usr/sbin:/usr/bin") or "/usr/sbin/nginx",
                             workdir=nginx_dir, docroot=work / "docroot", tls=make_tls(nginx_dir / "tls"),
                             ports={"http": free_port(), "https": free_port(), "norange": free_port()})
        server.docroot.mkdir(parents=True)
        server.start()
        layouts = {}
        for algo, (header, _peers) in ALGOS.items():
            for p in shards:
                digest = hashlib.new(algo)
                with open(p, "rb") as f:
                    while block := f.read(8 << 20):
                        digest.update(block)
                served = server.docroot / algo / p.name
                served.parent.mkdir(parents=True, exist_ok=True)
                os.link(p, served)  # one copy of the bytes on disk for the origin and the node
                os.chmod(served, 0o644)
                server.set_headers(f"{algo}/{p.name}", header(digest))
        for algo in ALGOS:
            # KServe's layout: one model per shard URI would be one file each; a folder model is
            # what an operator has, so each shard is its own model here and all are verified.
            root = work / f"root-{algo}"
            files = []
            uris = []
            for p in shards:
                uri = server.url(f"{algo}/{p.name}")
                folder = root / "models" / storage_key(uri)
                folder.mkdir(parents=True)
                os.link(p, folder / p.name)
                files.append(folder / p.name)
                uris.append(uri)
            layouts[algo] = (root, uris, files)
        runs: list[Run] = []
        for rnd in range(args.rounds):
            order = list(ALGOS)
            for algo in order[rnd % len(order):] + order[:rnd % len(order)]:
                root, uris, files = layouts[algo]
                peers = ALGOS[algo][1]
                tools = ["modelcache", *peers]
                shift = rnd % len(tools)
                for name in tools[shift:] + tools[:shift]:  # each tool first in turn
                    if name == "modelcache":
                        parts = [run_modelcache(u, root, [f], algo) for u, f in zip(uris, files, strict=True)]
                        runs.append(Run("modelcache", algo, sum(r.seconds for r in parts), sum(r.cpu for r in parts),
                                        sum(r.bytes for r in parts)))
                    else:
                        runs.append(run_peer(name, peers[name], files, algo))
                    print(f"round {rnd + 1} {algo:6} {runs[-1].tool:11} {runs[-1].seconds:7.2f} s", flush=True)
        print()
        print(report(runs, args.concurrency, load))
        with open("/proc/loadavg") as f:
            print(f"load after: {' '.join(f.read().split()[:3])}")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
