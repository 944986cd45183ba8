#!/usr/bin/env python3
"""Benchmark: pull a model-shaped folder over HTTP with modelcache and its peers.

A folder of N shards (default 8 x 512 MiB) plus two small json files is served by nginx on
127.0.0.1. Each round runs every tool once, in an order that rotates between rounds, into a
fresh folder on the same disk; a run is timed until its files are durable (each output file is
fsynced before the clock stops, also for tools that already fsync). ``dd oflag=direct`` gives the
disk's durable write rate in the same run. The script prints median MB/s (1 MB = 10^6 bytes)
per tool, the ratio of modelcache to each, CPU seconds per GiB (user + system of the pulling
process and its children, from wait4), peak RSS, modelcache's fixed cost (wall time beyond its
transfer: start-up, listing, publishing) and the machine's load average before and after.

    .venv/bin/python bench/pull_http.py                 # 4 GiB, 3 rounds (minutes)
    .venv/bin/python bench/pull_http.py --shards 1      # one 4 GiB file
    .venv/bin/python bench/pull_http.py --size 256MiB --rounds 1    # quick check
    .venv/bin/python bench/pull_http.py --cpus 1        # every client limited to one CPU

``--cpus N`` runs each client in a CPU cgroup with a quota of N CPUs (what a pod's CPU limit
does; the agent's DaemonSet sets 2) and, where the machine has more than N CPUs, pins the
clients to N of them and the server to the others, so the server does not compete for the
client's share. modelcache runs from precompiled bytecode (as in the image, which compiles it
at build time) even where PYTHONDONTWRITEBYTECODE is set.

Tools: modelcache (every file URI in one ``modelcache pull`` call), aria2c (-x16 -s16 -i list),
curl (one stream per file, all files in parallel), kserve-storage (``Storage.download`` per file,
from its own venv under .work/ so its dependencies stay out of ours).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.rss import RssSampler  # noqa: E402  (needs the repo on sys.path)
from modelcache.runtime import sizes  # noqa: E402
from tests.fixtures.http import NginxServer, make_tls  # noqa: E402
from tests.helpers import free_port  # noqa: E402

KSERVE_VENV = REPO / ".work" / "kserve-venv"
KSERVE_VERSION = "0.21.0"
SMALL_FILES = {
    "config.json": json.dumps({"architectures": ["BenchModel"], "hidden_size": 4096}, indent=2).encode(),
    "tokenizer_config.json": json.dumps({"model_max_length": 4096}).encode(),
}


def parse_size(text: str) -> int:
    """modelcache's one size syntax (binary: 64M = 64Mi = 64MiB), as an argparse type."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---- data ---------------------------------------------------------------------------------


def make_model(folder: Path, total: int, shards: int) -> list[str]:
    """Write (or reuse) the shards and json files; returns the relative file names."""
    folder.mkdir(parents=True, exist_ok=True)
    shard_size = total // shards
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    block = random.Random(1).randbytes(16 << 20)
    for i, name in enumerate(names):
        path = folder / name
        if path.exists() and path.stat().st_size == shard_size:
            continue
        with open(path, "wb") as fh:
            left, n = shard_size, 0
            while left:
                # A per-block prefix keeps blocks distinct; the content itself does not matter to HTTP.
                piece = (i.to_bytes(4, "little") + n.to_bytes(8, "little") + block[12:])[: min(left, len(block))]
                fh.write(piece)
                left -= len(piece)
                n += 1
    for name, data in SMALL_FILES.items():
        (folder / name).write_bytes(data)
    for p in folder.iterdir():
        os.chmod(p, 0o644)
    return [*names, *SMALL_FILES]


def fsync_tree(folder: Path) -> int:
    """fsync every file and folder below ``folder``; returns the bytes found (to check completeness)."""
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return total


# ---- tools --------------------------------------------------------------------------------


@dataclass
class RunResult:
    tool: str
    seconds: float
    bytes: int
    peak_rss_kib: int
    cpu_seconds: float = 0.0
    #: modelcache only: wall seconds beyond its transfer (process start to published, less the
    #: ``transfer_seconds`` its --json reports).
    fixed_seconds: float | None = None

    @property
    def mbps(self) -> float:
        return self.bytes / self.seconds / 1e6

    @property
    def cpu_per_gib(self) -> float:
        return self.cpu_seconds / (self.bytes / 2**30)


# ---- the client's CPUs ----------------------------------------------------------------------


@dataclass
class CpuLimit:
    """``--cpus N``: a CPU cgroup with a quota of N CPUs for every client, the clients pinned to N
    CPUs and the server to the rest when the machine has more."""

    cpus: float
    cgroup: Path | None = None
    client_cpus: set[int] | None = None
    server_cpus: set[int] | None = None
    stat: dict[str, int] = field(default_factory=dict)  # the cgroup's cpu.stat when it was removed

    @classmethod
    def make(cls, cpus: float | None) -> CpuLimit | None:
        if cpus is None:
            return None
        limit = cls(cpus)
        have = sorted(os.sched_getaffinity(0))
        whole = max(1, int(cpus + 0.999))
        if len(have) > whole:
            limit.client_cpus, limit.server_cpus = set(have[:whole]), set(have[whole:])
        period = 100_000
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        base = Path("/sys/fs/cgroup") if v2.exists() else Path("/sys/fs/cgroup/cpu")
        group = base / f"modelcache-bench-{os.getpid()}"
        try:
            group.mkdir()
            if v2.exists():
                (group / "cpu.max").write_text(f"{int(cpus * period)} {period}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(period))
                (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
            limit.cgroup = group
        except OSError as exc:
            sys.exit(f"--cpus needs a CPU cgroup it can create ({group}: {exc.strerror}); run as root")
        return limit

    def describe(self) -> str:
        where = (f"clients on CPUs {sorted(self.client_cpus)}, server on {sorted(self.server_cpus or [])}"
                 if self.client_cpus else f"the server shares the client's {os.cpu_count()} CPUs")
        bite = (f"; the quota held them back in {self.stat.get('nr_throttled', 0)} of "
                f"{self.stat.get('nr_periods', 0)} 100 ms periods" if self.stat else "")
        return f"clients limited to {self.cpus:g} CPU (cgroup quota; {where}{bite})"

    def enter(self) -> None:
        """In the client's process before exec (preexec_fn)."""
        if self.cgroup is not None:
            procs = self.cgroup / ("cgroup.procs" if (self.cgroup / "cgroup.procs").exists() else "tasks")
            procs.write_text(str(os.getpid()))
        if self.client_cpus:
            os.sched_setaffinity(0, self.client_cpus)

    @contextlib.contextmanager
    def server(self) -> Iterator[None]:
        """Around starting the server: it inherits the server's CPUs."""
        if not self.server_cpus:
            yield
            return
        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.server_cpus)
        try:
            yield
        finally:
            os.sched_setaffinity(0, mine)

    def close(self) -> None:
        if self.cgroup is not None:
            with contextlib.suppress(OSError, ValueError):
                self.stat = {k: int(v) for k, v in
                             (ln.split() for ln in (self.cgroup / "cpu.stat").read_text().splitlines())}
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()


#: Set by main() from --cpus; every client run goes through it.
CPU_LIMIT: CpuLimit | None = None


@contextlib.contextmanager
def server_cpus() -> Iterator[None]:
    with CPU_LIMIT.server() if CPU_LIMIT is not None else contextlib.nullcontext():
        yield


def modelcache_cmd() -> list[str]:
    exe = REPO / ".venv" / "bin" / "modelcache"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "modelcache"]


def modelcache_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """modelcache's environment, with its bytecode compiled beside its sources first (git ignores
    __pycache__), as the image has it: where PYTHONDONTWRITEBYTECODE is set (these machines) every
    run otherwise compiled modelcache's sources again."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "modelcache")], check=True,
                   stdout=subprocess.DEVNULL)
    return dict(env if env is not None else os.environ)


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run_timed(tool: str, cmd: list[str], out: Path, total_bytes: int, env: dict[str, str] | None = None,
              report_json: bool = False) -> RunResult:
    """Run ``cmd``, then fsync what it wrote; time both (shared by the benchmarks).

    Peak RSS is sampled from /proc; CPU comes from wait4 (it includes waited-for children, e.g.
    kserve's process pool). ``report_json``: ``cmd`` prints modelcache's --json, whose transfer
    time gives the run's fixed cost.
    """
    # stderr goes to a file, not a pipe: a chatty tool must never block on a full pipe mid-run.
    with tempfile.TemporaryFile() as errfile, tempfile.TemporaryFile() as outfile:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=outfile if report_json else subprocess.DEVNULL, stderr=errfile, env=env,
                                preexec_fn=CPU_LIMIT.enter if CPU_LIMIT is not None else None)
        sampler = RssSampler(proc.pid)
        _pid, status, usage = os.wait4(proc.pid, 0)
        peak = sampler.stop()
        rc = os.waitstatus_to_exitcode(status)
        errfile.seek(0)
        err = errfile.read().decode(errors="replace")
        outfile.seek(0)
        printed = outfile.read().decode(errors="replace")
    if rc != 0:
        raise RuntimeError(f"{tool} failed (exit {rc}): {err.strip()[-1500:]}")
    found = fsync_tree(out)
    seconds = time.perf_counter() - t0
    if found < total_bytes:
        raise RuntimeError(f"{tool} wrote {found} bytes, expected at least {total_bytes}")
    fixed = None
    if report_json:
        fixed = seconds - max(r.get("transfer_seconds", 0.0) for r in json.loads(printed))
    return RunResult(tool, seconds, total_bytes, peak, usage.ru_utime + usage.ru_stime, fixed)


def results_table(results: list[RunResult], title: str) -> tuple[list[str], dict[str, float]]:
    """The markdown table every benchmark prints, and the median MB/s per tool."""
    by_tool: dict[str, list[RunResult]] = {}
    for r in results:
        by_tool.setdefault(r.tool, []).append(r)
    med = {t: statistics.median(x.mbps for x in rs) for t, rs in by_tool.items()}
    mc = med.get("modelcache")
    lines = [
        title,
        "",
        "| tool | median MB/s | runs (MB/s) | modelcache / tool | CPU s/GiB | peak RSS MiB |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for tool, rs in by_tool.items():
        ratio = f"{mc / med[tool]:.2f}x" if mc and tool != "modelcache" else "-"
        runs = ", ".join(f"{x.mbps:.0f}" for x in rs)
        cpu = statistics.median(x.cpu_per_gib for x in rs)
        rss = max(x.peak_rss_kib for x in rs) / 1024
        lines.append(f"| {tool} | {med[tool]:.0f} | {runs} | {ratio} | {cpu:.2f} | {rss:.0f} |")
    return lines, med


@dataclass
class Bench:
    urls: list[str]
    total_bytes: int
    out_root: Path
    workers: int | None
    chunk_size: str | None
    results: list[RunResult] = field(default_factory=list)
    modelcache_env: dict[str, str] = field(default_factory=modelcache_env)

    def _timed(self, tool: str, cmd: list[str], out: Path, env: dict[str, str] | None = None) -> RunResult:
        return run_timed(tool, cmd, out, self.total_bytes, env)

    def modelcache(self, out: Path) -> RunResult:
        cmd = [*modelcache_cmd(), "pull", *self.urls, "--root", str(out), "--json", "--progress", "none"]
        if self.workers:
            cmd += ["--workers", str(self.workers)]
        if self.chunk_size:
            cmd += ["--chunk-size", self.chunk_size]
        return run_timed("modelcache", cmd, out, self.total_bytes, self.modelcache_env, report_json=True)

    def aria2c(self, out: Path) -> RunResult:
        return aria2c(self._timed, [(u, u.rsplit("/", 1)[1]) for u in self.urls], out)

    def curl(self, out: Path) -> RunResult:
        return curl(self._timed, [(u, u.rsplit("/", 1)[1]) for u in self.urls], out)

    def kserve(self, out: Path) -> RunResult:
        out.mkdir(parents=True, exist_ok=True)
        script = (
            "import sys\nfrom kserve_storage import Storage\n"
            "out = sys.argv[1]\nfor uri in sys.argv[2:]:\n    Storage.download(uri, out)\n"
        )
        cmd = [str(KSERVE_VENV / "bin" / "python"), "-c", script, str(out), *self.urls]
        return self._timed("kserve-storage", cmd, out)

    def dd(self, out: Path) -> RunResult:
        out.mkdir(parents=True, exist_ok=True)
        bs = 16 << 20
        count = max(1, self.total_bytes // bs)
        cmd = ["dd", "if=/dev/zero", f"of={out / 'dd.bin'}", f"bs={bs}", f"count={count}",
               "oflag=direct", "conv=fsync", "status=none"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        fsync_tree(out)
        return RunResult("dd oflag=direct", time.perf_counter() - t0, count * bs, 0)


def ensure_kserve_venv() -> bool:
    py = KSERVE_VENV / "bin" / "python"
    probe = [str(py), "-c", "import kserve_storage"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return True
    print(f"installing kserve-storage=={KSERVE_VERSION} into {KSERVE_VENV} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(KSERVE_VENV)], check=True)
    r = subprocess.run([str(KSERVE_VENV / "bin" / "pip"), "install", "-q", f"kserve-storage=={KSERVE_VERSION}"])
    return r.returncode == 0 and subprocess.run(probe, capture_output=True).returncode == 0


# ---- report -------------------------------------------------------------------------------


# ---- the peers on plain URLs, shared by the benchmarks ----------------------------------------

Timed = Callable[[str, list[str], Path], RunResult]


def aria2c(timed: Timed, files: list[tuple[str, str]], out: Path) -> RunResult:
    """aria2c -x16 -s16 over (url, file name) pairs into ``out``."""
    listing = out.parent / f"{out.name}.aria2-list.txt"
    listing.write_text("".join(f"{u}\n  out={n}\n" for u, n in files))
    cmd = ["aria2c", "-x16", "-s16", "-i", str(listing), "-d", str(out), "-q",
           "--allow-overwrite=true", "--auto-file-renaming=false", "--console-log-level=error"]
    try:
        return timed("aria2c", cmd, out)
    finally:
        listing.unlink(missing_ok=True)


def curl(timed: Timed, files: list[tuple[str, str]], out: Path) -> RunResult:
    """curl, one stream per file, all at once."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["curl", "-sS", "--fail", "--parallel", "--parallel-max", str(len(files))]
    for u, n in files:
        cmd += ["-o", str(out / n), u]
    return timed("curl", cmd, out)


# ---- the run, shared by the benchmarks -------------------------------------------------------


def bench_args(description: str, tools: str, tools_help: str, workdir: Path) -> argparse.ArgumentParser:
    """The flags every pull benchmark takes; a benchmark adds its own (a server, say)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=parse_size("4GiB"), help="total shard bytes (default 4GiB)")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tools", default=tools, help=f"comma-separated subset of {tools_help}")
    ap.add_argument("--workdir", type=Path, default=workdir, help="data and outputs (same disk for every tool)")
    ap.add_argument("--workers", type=int, help="pass --workers to modelcache pull")
    ap.add_argument("--chunk-size", help="pass --chunk-size to modelcache pull")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument("--cpus", type=float, help="limit every client to this many CPUs (cgroup quota; see above)")
    return ap


def usable_tools(spec: str) -> list[str]:
    """The tools of ``--tools`` that this machine has (a missing one is said and skipped)."""
    tools = [t.strip() for t in spec.split(",") if t.strip()]
    if "kserve-storage" in tools and not ensure_kserve_venv():
        print("kserve-storage could not be installed; skipping it", file=sys.stderr)
        tools.remove("kserve-storage")
    for exe, tool in (("aria2c", "aria2c"), ("curl", "curl")):
        if tool in tools and shutil.which(exe) is None:
            print(f"{exe} not found (make test-deps); skipping it", file=sys.stderr)
            tools.remove(tool)
    return tools


def run_rounds(tools: list[str], rounds: int, runners: dict[str, Callable[[Path], RunResult]],
               out_root: Path) -> list[RunResult]:
    """Every tool once per round into a fresh folder, in an order that rotates between rounds
    (no tool always goes first)."""
    results = []
    for rnd in range(rounds):
        order = tools[rnd % len(tools):] + tools[: rnd % len(tools)]
        for tool in order:
            out = out_root / f"{tool}-{rnd}"
            shutil.rmtree(out, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                res = runners[tool](out)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            results.append(res)
            fixed = f", fixed cost {res.fixed_seconds:.2f} s" if res.fixed_seconds is not None else ""
            print(f"round {rnd + 1}: {res.tool:16s} {res.mbps:8.0f} MB/s  ({res.seconds:.2f} s, "
                  f"{res.cpu_per_gib:.2f} CPU-s/GiB, peak RSS {res.peak_rss_kib / 1024:.0f} MiB{fixed}; "
                  f"load {load_average()})", flush=True)
    return results


def conditions(args: argparse.Namespace, load_before: str) -> str:
    """The run's conditions, for the docs: load average (1/5/15 min) before and after, CPU limit."""
    limit = f"; {CPU_LIMIT.describe()}" if CPU_LIMIT is not None else ""
    return f"load average {load_before} before, {load_average()} after{limit}"


def modelcache_targets(results: list[RunResult], cpu_target: float | None, forced: float = 0.0,
                       forced_name: str = "") -> list[str]:
    """The issue-28 targets every benchmark shares: CPU per GiB beyond a forced checksum, peak
    RSS and fixed cost."""
    mine = [x for x in results if x.tool == "modelcache"]
    if not mine:
        return []
    lines = [""]
    if cpu_target is not None:
        cpu = statistics.median(x.cpu_per_gib for x in mine)
        beyond = f" - {forced_name} {forced:.2f} = {cpu - forced:.2f}" if forced else ""
        ok = cpu - forced <= cpu_target
        lines.append(f"target CPU <= {cpu_target} s/GiB beyond a forced checksum: {cpu:.2f}{beyond} "
                     f"{'OK' if ok else 'MISSED'}")
    rss = max(x.peak_rss_kib for x in mine) / 1024
    lines.append(f"target peak RSS <= 200 MiB: {rss:.0f} {'OK' if rss <= 200 else 'MISSED'}")
    fixed = [x.fixed_seconds for x in mine if x.fixed_seconds is not None]
    if fixed:
        f = statistics.median(fixed)
        lines.append(f"modelcache fixed cost (wall beyond transfer): median {f:.2f} s, runs "
                     f"{', '.join(f'{x:.2f}' for x in fixed)} (target <= 0.3 s: {'OK' if f <= 0.3 else 'MISSED'})")
    return lines


def report(results: list[RunResult], args: argparse.Namespace, load_before: str = "") -> str:
    lines, med = results_table(
        results,
        f"HTTP pull benchmark: {args.shards} x {args.size // args.shards / 2**20:.0f} MiB + json "
        f"({args.size / 2**30:.2f} GiB), {args.rounds} round(s), durable (fsync) MB/s, 1 MB = 10^6 B; "
        f"{conditions(args, load_before)}",
    )
    mc = med.get("modelcache")
    lines += modelcache_targets(results, 0.4)
    targets = {"kserve-storage": 1.5, "aria2c": 1.3, "dd oflag=direct": 0.9}
    if mc:
        for tool, want in targets.items():
            if tool in med:
                got = mc / med[tool]
                lines.append(f"target modelcache >= {want}x {tool}: {got:.2f}x {'OK' if got >= want else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global CPU_LIMIT
    tools_all = "modelcache,aria2c,curl,kserve-storage,dd"
    args = bench_args(__doc__ or "", tools_all, tools_all, REPO / ".work" / "bench-http").parse_args(argv)
    tools = usable_tools(args.tools)
    CPU_LIMIT = CpuLimit.make(args.cpus)
    load_before = load_average()

    work = args.workdir.resolve()
    data = work / f"data-{args.shards}x{args.size // args.shards}"
    print(f"preparing {args.size / 2**30:.2f} GiB in {data} ...", flush=True)
    names = make_model(data, args.size, args.shards)
    total = sum((data / n).stat().st_size for n in names)
    # Warm the source into the page cache once, so no tool's first run pays for nginx reading
    # the disk while it writes (round 1 was ~half speed for every tool without this).
    for n in names:
        with open(data / n, "rb") as fh:
            while fh.read(8 << 20):
                pass

    nginx_dir = Path(tempfile.mkdtemp(prefix="nginx-", dir=work))
    server = NginxServer(
        binary=shutil.which("nginx", path="/usr/sbin:/usr/bin") or "/usr/sbin/nginx",
        workdir=nginx_dir, docroot=data, tls=make_tls(nginx_dir / "tls"),
        ports={"http": free_port(), "https": free_port(), "norange": free_port()},
    )
    with server_cpus():
        server.start()
    try:
        bench = Bench(urls=[server.url(n) for n in names], total_bytes=total, out_root=work / "out",
                      workers=args.workers, chunk_size=args.chunk_size)
        runners: dict[str, Callable[[Path], RunResult]] = {
            "modelcache": bench.modelcache, "aria2c": bench.aria2c, "curl": bench.curl,
            "kserve-storage": bench.kserve, "dd": bench.dd,
        }
        bench.results += run_rounds(tools, args.rounds, runners, bench.out_root)
    finally:
        server.stop()
        shutil.rmtree(nginx_dir, ignore_errors=True)
        if CPU_LIMIT is not None:
            CPU_LIMIT.close()
    print()
    print(report(bench.results, args, load_before))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in bench.results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
