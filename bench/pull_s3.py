#!/usr/bin/env python3
"""Benchmark: pull a model-shaped folder from a local S3 server with modelcache and its peers.

A folder of N shards (default 8 x 512 MiB) plus two small json files is uploaded once to
SeaweedFS (a production S3 server, built by tests/setup.d/60-seaweedfs.sh), s3rver (npm, a
Node.js test server that streams ranges from files) or moto_server, on 127.0.0.1.
Each round runs every tool once, in an order that rotates between rounds, into a fresh folder;
a run is timed until its files are durable (fsynced). Prints median MB/s (1 MB = 10^6 B),
modelcache's ratio to each peer, client CPU seconds per GiB and peak RSS.

    .venv/bin/python bench/pull_s3.py                             # SeaweedFS, 4 GiB, 3 rounds
    .venv/bin/python bench/pull_s3.py --server s3rver             # the Node.js test server
    .venv/bin/python bench/pull_s3.py --server moto --size 1GiB   # moto (measures moto's ranged GETs)
    .venv/bin/python bench/pull_s3.py --size 256MiB --rounds 1    # quick check

Tools: modelcache (``modelcache pull s3://...``), s5cmd (``cp 's3://b/m/*'``), boto3
``download_file`` with a tuned TransferConfig (files in parallel), aria2c (-x16 -s16) and curl
(one stream per file, in parallel) on presigned URLs, and KServe's initializer
(``kserve_storage.Storage.download``, S3 path, from its own venv under .work/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import pull_http  # noqa: E402
from pull_http import (  # noqa: E402
    CpuLimit,
    RunResult,
    aria2c,
    bench_args,
    conditions,
    curl,
    load_average,
    make_model,
    modelcache_cmd,
    modelcache_env,
    modelcache_targets,
    results_table,
    run_rounds,
    run_timed,
    server_cpus,
    usable_tools,
)

from tests.helpers import free_port, port_open, wait_until  # noqa: E402

KSERVE_VENV = REPO / ".work" / "kserve-venv"
S3RVER_DIR = REPO / ".work" / "s3rver"
S3RVER_VERSION = "3.7.1"
BUCKET = "models"
PREFIX = "bench-model"
KEY, SECRET = "S3RVER", "S3RVER"  # s3rver's fixed development credentials (SeaweedFS is given them too)


# ---- servers ------------------------------------------------------------------------------


def ensure_s3rver() -> Path:
    script = S3RVER_DIR / "node_modules" / "s3rver" / "bin" / "s3rver.js"
    if not script.exists():
        print(f"installing s3rver@{S3RVER_VERSION} into {S3RVER_DIR} ...", flush=True)
        S3RVER_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--no-save",
                        f"s3rver@{S3RVER_VERSION}"], cwd=S3RVER_DIR, check=True)
    return script


def start_server(kind: str, work: Path, dataset: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(work / f"{kind}.log", "wb")  # noqa: SIM115 - lives as long as the server
    if kind == "seaweedfs":
        from tests.fixtures.seaweedfs import WEED, start_seaweedfs

        if not WEED.exists():
            sys.exit(f"{WEED} is missing: run bash tests/setup.d/60-seaweedfs.sh first")
        log.close()
        # Its data folder is kept between runs of one data set, so a second run skips the upload.
        # One folder per data set: a restarted SeaweedFS rebuilds its master state and then
        # refuses to grow volumes ("volume growth frozen"), so a new data set needs a new folder.
        server = start_seaweedfs(work / f"seaweedfs-{dataset}", KEY, SECRET)
        return server.proc, server.endpoint
    if kind == "s3rver":
        data = work / "s3rver-data"
        data.mkdir(parents=True, exist_ok=True)
        cmd = ["node", str(ensure_s3rver()), "-d", str(data), "-a", "127.0.0.1", "-p", str(port), "--silent",
               "--configure-bucket", BUCKET]
    else:
        cmd = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_until(lambda: port_open(port), 30, what=kind)
    return proc, f"http://127.0.0.1:{port}"


def s3_client(endpoint: str):  # type: ignore[no-untyped-def]
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                        region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, max_pool_connections=32))


def upload(endpoint: str, data: Path, names: list[str]) -> None:
    """Upload each file once (single PUT, so the ETag is the MD5 modelcache verifies)."""
    from boto3.s3.transfer import TransferConfig

    c = s3_client(endpoint)
    try:
        c.head_bucket(Bucket=BUCKET)
    except Exception:
        c.create_bucket(Bucket=BUCKET)
    cfg = TransferConfig(multipart_threshold=8 << 30)
    for n in names:
        size = (data / n).stat().st_size
        try:
            if c.head_object(Bucket=BUCKET, Key=f"{PREFIX}/{n}")["ContentLength"] == size:
                continue
        except Exception:
            pass
        print(f"uploading {n} ...", flush=True)
        c.upload_file(str(data / n), BUCKET, f"{PREFIX}/{n}", Config=cfg)


# ---- tools --------------------------------------------------------------------------------


@dataclass
class Bench:
    endpoint: str
    names: list[str]
    total_bytes: int
    workers: int | None
    chunk_size: str | None
    results: list[RunResult] = field(default_factory=list)
    modelcache_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.modelcache_env = modelcache_env(self.env)

    @property
    def env(self) -> dict[str, str]:
        return os.environ | {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                             "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
                             "AWS_REGION": "us-east-1"}

    def _timed(self, tool: str, cmd: list[str], out: Path) -> RunResult:
        return run_timed(tool, cmd, out, self.total_bytes, self.env)

    def presigned(self) -> list[str]:
        c = s3_client(self.endpoint)
        return [c.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": f"{PREFIX}/{n}"},
                                         ExpiresIn=3600) for n in self.names]

    def modelcache(self, out: Path) -> RunResult:
        cmd = [*modelcache_cmd(), "pull", f"s3://{BUCKET}/{PREFIX}", "--root", str(out), "--progress", "none", "--json"]
        if self.workers:
            cmd += ["--workers", str(self.workers)]
        if self.chunk_size:
            cmd += ["--chunk-size", self.chunk_size]
        return run_timed("modelcache", cmd, out, self.total_bytes, self.modelcache_env, report_json=True)

    def modelcache_http(self, out: Path) -> RunResult:
        """modelcache on the same objects as presigned HTTP URLs: its HTTP path, for the S3
        path's CPU target (the HTTP source verifies no object-store checksum: xxh3 only)."""
        cmd = [*modelcache_cmd(), "pull", *self.presigned(), "--root", str(out), "--progress", "none"]
        if self.workers:
            cmd += ["--workers", str(self.workers)]
        if self.chunk_size:
            cmd += ["--chunk-size", self.chunk_size]
        return run_timed("modelcache-http", cmd, out, self.total_bytes, self.modelcache_env)

    def s5cmd(self, out: Path) -> RunResult:
        exe = Path(sys.executable).parent / "s5cmd"
        cmd = [str(exe), "--endpoint-url", self.endpoint, "cp", f"s3://{BUCKET}/{PREFIX}/*", f"{out}/"]
        return self._timed("s5cmd", cmd, out)

    def boto3(self, out: Path) -> RunResult:
        script = (
            "import sys, boto3\nfrom concurrent.futures import ThreadPoolExecutor\n"
            "from boto3.s3.transfer import TransferConfig\nfrom botocore.config import Config\n"
            "ep, out, bucket, prefix, *names = sys.argv[1:]\n"
            "c = boto3.client('s3', endpoint_url=ep, config=Config(max_pool_connections=64))\n"
            "cfg = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=16, use_threads=True)\n"
            "def one(n): c.download_file(bucket, f'{prefix}/{n}', f'{out}/{n}', Config=cfg)\n"
            "with ThreadPoolExecutor(4) as ex: list(ex.map(one, names))\n"
        )
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-c", script, self.endpoint, str(out), BUCKET, PREFIX, *self.names]
        return self._timed("boto3 tuned", cmd, out)

    def aria2c(self, out: Path) -> RunResult:
        return aria2c(self._timed, list(zip(self.presigned(), self.names, strict=True)), out)

    def curl(self, out: Path) -> RunResult:
        return curl(self._timed, list(zip(self.presigned(), self.names, strict=True)), out)

    def kserve(self, out: Path) -> RunResult:
        out.mkdir(parents=True, exist_ok=True)
        script = "import sys\nfrom kserve_storage import Storage\nStorage.download(sys.argv[1], sys.argv[2])\n"
        cmd = [str(KSERVE_VENV / "bin" / "python"), "-c", script, f"s3://{BUCKET}/{PREFIX}", str(out)]
        return self._timed("kserve-storage", cmd, out)


# ---- report -------------------------------------------------------------------------------


def checksum_cost(endpoint: str) -> tuple[str, float]:
    """The checksum modelcache verifies on the biggest shard and its CPU seconds per GiB here
    (hashed in this process, 256 MiB from memory): what the S3 path must pay beyond HTTP."""
    import time

    from modelcache.sources.base import open_source
    from modelcache.sources.credentials import Settings
    from modelcache.sources.integrity import new_hasher

    env = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": endpoint,
           "AWS_DEFAULT_REGION": "us-east-1"}
    with open_source(f"s3://{BUCKET}/{PREFIX}", Settings.from_env(env)) as src:
        shard = max(src.list_files(), key=lambda f: f.size or 0)
    if not shard.checksums:
        return "none", 0.0
    checksum = shard.checksums[0]
    buf = memoryview(os.urandom(16 << 20))
    hasher = new_hasher(checksum, 256 << 20)
    t = time.process_time()
    for _ in range(16):
        hasher.update(buf)
    return checksum.algo, (time.process_time() - t) * 4  # 256 MiB -> per GiB


def report(results: list[RunResult], args: argparse.Namespace, checksum: tuple[str, float] | None = None,
           load_before: str = "") -> str:
    lines, med = results_table(
        results,
        f"S3 pull benchmark ({args.server}): {args.shards} x {args.size // args.shards / 2**20:.0f} MiB + json "
        f"({args.size / 2**30:.2f} GiB), {args.rounds} round(s), durable MB/s, 1 MB = 10^6 B; "
        f"{conditions(args, load_before)}",
    )
    algo, cost = checksum if checksum is not None else ("none", 0.0)
    lines += modelcache_targets(results, 0.4, cost, algo)
    mc = med.get("modelcache")
    if mc:
        peers = {t: v for t, v in med.items() if t not in ("modelcache", "modelcache-http", "kserve-storage")}
        if peers:
            best = max(peers, key=lambda t: peers[t])
            got = mc / peers[best]
            lines.append(f"\ntarget >= 1.0x the best peer ({best}): {got:.2f}x {'OK' if got >= 1.0 else 'MISSED'}")
        if "kserve-storage" in med and args.server != "moto":
            got = mc / med["kserve-storage"]
            lines.append(f"target >= 2.0x kserve-storage: {got:.2f}x {'OK' if got >= 2.0 else 'MISSED'}")
        mrs = [x for x in results if x.tool == "modelcache"]
        cpu = statistics.median(x.cpu_per_gib for x in mrs)
        https = [x for x in results if x.tool == "modelcache-http"]
        if https and checksum is not None:
            http_cpu = statistics.median(x.cpu_per_gib for x in https)
            bound = 1.2 * (http_cpu + cost)
            lines.append(f"target S3 CPU <= 1.2 x (HTTP path {http_cpu:.2f} + {algo} {cost:.2f}) = {bound:.2f} s/GiB: "
                         f"{cpu:.2f} ({cpu / (http_cpu + cost):.2f}x) {'OK' if cpu <= bound else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    tools_all = "modelcache,modelcache-http,s5cmd,boto3,aria2c,curl,kserve-storage"
    ap = bench_args(__doc__ or "", tools_all, tools_all.replace("-http,", "-http (its HTTP path on presigned URLs),"),
                    REPO / ".work" / "bench-s3")
    ap.add_argument("--server", choices=["seaweedfs", "s3rver", "moto"], default="seaweedfs")
    args = ap.parse_args(argv)
    tools = usable_tools(args.tools)
    pull_http.CPU_LIMIT = CpuLimit.make(args.cpus)
    load_before = load_average()

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"data-{args.shards}x{args.size // args.shards}"
    print(f"preparing {args.size / 2**30:.2f} GiB in {data} ...", flush=True)
    names = make_model(data, args.size, args.shards)
    total = sum((data / n).stat().st_size for n in names)
    with server_cpus():
        proc, endpoint = start_server(args.server, work, data.name)
    try:
        upload(endpoint, data, names)
        checksum = checksum_cost(endpoint)
        bench = Bench(endpoint, names, total, args.workers, args.chunk_size)
        runners: dict[str, Callable[[Path], RunResult]] = {
            "modelcache": bench.modelcache, "modelcache-http": bench.modelcache_http,
            "s5cmd": bench.s5cmd, "boto3": bench.boto3,
            "aria2c": bench.aria2c, "curl": bench.curl, "kserve-storage": bench.kserve,
        }
        bench.results += run_rounds(tools, args.rounds, runners, work / "out")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        if pull_http.CPU_LIMIT is not None:
            pull_http.CPU_LIMIT.close()
    print()
    print(report(bench.results, args, checksum, load_before))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in bench.results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
