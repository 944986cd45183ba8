"""A node group filled from an origin that is the bottleneck: with peer transfer, without, and one node alone.

On one real control plane (tests/cluster) with the coordinator running as its ServiceAccount,
N agents (separate processes, each with its own root and ports, deploy/'s RBAC and the peer
token deploy/ projects) fill one LocalModelCache of a multi-file model (a config and four
shards) on a node group of N nodes. The model is on S3 (moto) behind a proxy throttled to
``--origin-rate`` bytes/s in all (tests/faultproxy.py), which counts what the origin sends.
Three runs, each on nodes of its own with empty roots:

- ``p2p``: N agents with peer transfer;
- ``direct``: N agents with ``--peers=off`` (every node reads the origin);
- ``single``: one agent alone (``--peers=off``): the time one node needs.

Time is from creating the cache until every node's LocalModelNode says ModelDownloaded; every
node's files are then checked byte for byte (sha-256) against the source.

While the agents transfer, a probe (``LoadProbe``) measures every ``PROBE_EVERY`` seconds, for
``PROBE_DURING`` seconds, the share of a core one more process gets (``cpu_share_during_<mode>``:
[seconds since the cache was made, that share, the agents' runnable threads]). Beside each of
those samples, index for index, ``agents_during_<mode>`` records what every agent had used so far:

- ``at``: [the probe's start, its end], seconds since the cache was made, one pair a sample;
- ``cpu_seconds``: {agent: [[CPU-s at the probe's start, at its end], ...]}, user + system of the
  agent's process (/proc/<pid>/stat, all its threads; the agent starts no child processes) since
  the cache was made: an agent's cores in a window are the difference over the window's seconds;
- with ``--probe-metrics`` only: ``sent_bytes``: {agent: [bytes sent to peers by the probe's end,
  ...]}, its /metrics' modelcache_agent_peer_uploaded_bytes_total (counted piece by piece), and
  ``metrics_read_seconds``: [the wall seconds reading every agent's /metrics took, a sample]. Off
  by default: at 8 agents (bench/fleet-8-stop40.json, load 3) the reads took 0.01-1.37 s a sample
  (0.50 s mean: starved agents answer late), stretching the probe's 2 s cadence to 2.0-2.5 s.
  What an agent took in is not on its /metrics until its download ends.

    .venv/bin/python bench/fleet.py --nodes 8 --size 256Mi [--origin-rate 16Mi] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import profiler  # noqa: E402  (needs the repo on sys.path)
from coordinator.app import Config, Coordinator  # noqa: E402
from modelcache.kube.client import LOCAL_MODEL_CACHES, LOCAL_MODEL_NODES, Kube, load_api_client  # noqa: E402
from modelcache.runtime.sizes import parse_size  # noqa: E402
from tests.agent_util import AgentProc, start_agent  # noqa: E402
from tests.cluster.baseline import apply_manifests  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.coordinator_util import GROUP_LABEL, make_group, make_node  # noqa: E402
from tests.faultproxy import FaultProxy  # noqa: E402
from tests.fleet import S3Origin, model_files, peer_args, peer_token, storage_secret, upload_model  # noqa: E402
from tests.helpers import free_port, stop_process, wait_until  # noqa: E402

#: The agent's own defaults (tests/agent_util.start_agent passes test timings; these undo them: the
#: resync's 5 s, left in until stop 38, made every agent read its Node object 12 times as often).
AGENT_FLAGS = ("--chunk-size", "16Mi", "--workers", "8", "--transfer-attempts", "6", "--status-interval", "3",
               "--backoff-initial", "1", "--backoff-max", "5", "--resync-period", "60", "--removal-recheck", "10")
#: Seconds each agent's CPU is measured once every node holds the model (an idle agent: watches,
#: status, its supervisor; what 1,000 of them cost a fleet doing nothing).
IDLE_SECONDS = 30.0


def start_moto(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with open(workdir / "moto.log", "wb") as log:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    wait_until(lambda: urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).status == 200, timeout=60,
               what="moto_server")
    return proc, endpoint


def pid_cpu_seconds(pid: int) -> float:
    """User + system CPU a process (all its threads) used so far (/proc/<pid>/stat); 0 once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(agent: AgentProc) -> float:
    """User + system CPU the agent process used so far."""
    return pid_cpu_seconds(agent.proc.pid)


#: A process that only computes, for PROBE_SECONDS: the CPU it got over the wall time it ran is the
#: share of a core one more runnable process gets on this machine now (bench/swarm_sim.py's CPU
#: model gives each agent that share of the machine's cores, measured, not read off the load).
PROBE = ("import time\nt, c = time.monotonic(), time.process_time()\n"
         "while time.monotonic() - t < {s}: sum(range(1000))\n"
         "print((time.process_time() - c) / (time.monotonic() - t))")
PROBE_SECONDS = 3.0


def cpu_share(seconds: float = PROBE_SECONDS) -> float:
    """Cores one more runnable process gets now (0..1), measured by PROBE."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(s=seconds)], capture_output=True, text=True,
                         check=True, timeout=120)
    return round(float(out.stdout), 3)


def runnable_threads(pids: list[int]) -> int:
    """Threads of these processes running or waiting for a core now (state R in /proc)."""
    n = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            n += stat.rsplit(")", 1)[1].split()[0] == "R"
    return n


#: The probe repeated while the agents transfer (the load moved from 13 to 41 during one 57 s run,
#: bench/fleet-16.json: one probe before the run said nothing of it): PROBE_DURING seconds of it
#: every PROBE_EVERY seconds, the agents' runnable threads sampled meanwhile.
PROBE_DURING, PROBE_EVERY = 1.0, 2.0


class LoadProbe:
    """The probe, repeated in a thread until stopped: at each, seconds since ``t0``, the share of
    a core the probe got, and the agents' runnable threads (the mean of samples taken while it
    ran). From the share ``s`` and those threads ``a`` the other processes competing for the
    ``cpus`` cores are ``cpus / s - 1 - a`` (the scheduler's fair share per runnable thread):
    what bench/swarm_sim.py gives the agents' cores over time.

    Beside each sample (``series``): every agent's CPU-s since ``cpu0`` at the probe's start and
    end, and, with ``sent``, the bytes it sent to peers by the end: what the agents themselves
    used in the windows whose share the model offers them (issue #30: the model offered 1.3-1.8x
    what the agents used in all, and the totals could not say in which windows)."""

    def __init__(self, agents: dict[str, int], t0: float, cpu0: dict[str, float] | None = None,
                 sent: Callable[[str], float] | None = None, during: float = PROBE_DURING,
                 every: float = PROBE_EVERY) -> None:
        self.agents, self.t0, self.sent, self.during, self.every = agents, t0, sent, during, every
        self.cpu0 = cpu0 or {}
        self.samples: list[tuple[float, float, float]] = []
        self.at: list[tuple[float, float]] = []
        self.cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in agents}
        self.sent_bytes: dict[str, list[int]] = {name: [] for name in agents}
        self.metrics_seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-probe", daemon=True)

    def start(self) -> LoadProbe:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float, float]]:
        self._stop.set()
        self._thread.join(30)
        return self.samples

    def series(self) -> dict[str, Any]:
        """The agents' readings beside ``samples``, index for index (the module's docstring)."""
        out: dict[str, Any] = {"at": [list(w) for w in self.at],
                               "cpu_seconds": {n: [list(c) for c in rows] for n, rows in self.cpu.items()}}
        if self.sent is not None:
            out["sent_bytes"] = self.sent_bytes
            out["metrics_read_seconds"] = self.metrics_seconds
        return out

    def _cpu(self) -> dict[str, float]:
        return {name: pid_cpu_seconds(pid) - self.cpu0.get(name, 0.0) for name, pid in self.agents.items()}

    def _run(self) -> None:
        pids = list(self.agents.values())
        while not self._stop.is_set():
            at = time.monotonic()
            before = self._cpu()
            proc = subprocess.Popen([sys.executable, "-c", PROBE.format(s=self.during)], stdout=subprocess.PIPE,
                                    text=True)
            counts: list[int] = []
            while proc.poll() is None:
                counts.append(runnable_threads(pids))
                time.sleep(0.2 * self.during)
            after, end = self._cpu(), time.monotonic()
            out = proc.stdout.read() if proc.stdout else ""
            if proc.stdout:
                proc.stdout.close()
            if proc.returncode == 0 and out.strip():
                self.samples.append((round(at - self.t0, 1), round(float(out), 3),
                                     round(sum(counts) / max(1, len(counts)), 2)))
                self.at.append((round(at - self.t0, 2), round(end - self.t0, 2)))
                for name in self.agents:
                    self.cpu[name].append((round(before[name], 2), round(after[name], 2)))
                if self.sent is not None:
                    read = time.monotonic()
                    for name in self.agents:
                        self.sent_bytes[name].append(int(self.sent(name)))
                    self.metrics_seconds.append(round(time.monotonic() - read, 3))
            self._stop.wait(max(0.0, self.every - (time.monotonic() - at)))


def rss_mib(agent: AgentProc) -> tuple[float, float]:
    """The agent's resident memory now and its peak (VmRSS, VmHWM), MiB."""
    try:
        status = Path(f"/proc/{agent.proc.pid}/status").read_text()
    except OSError:
        return 0.0, 0.0
    found = {k: int(v) / 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M)}
    return round(found.get("VmRSS", 0.0), 1), round(found.get("VmHWM", 0.0), 1)


#: What the agents' logs say about their peers, counted per run (modelcache/peers/swarm.py's lines):
#: a peer read that missed its deadline, a piece read from the origin after its budget ran out,
#: of those, pieces peers held (every holder busy until the stall bound), an owner waited for in vain.
PEER_EVENTS = {"too_slow": r"from \S+ too slow", "origin_fallbacks": r"no peer delivered it in",
               "origin_fallbacks_held": r"no peer delivered it in \d+s \(held,",
               "owners_missed": r"did not read it in"}


#: The agent's counter of bytes sent to peers (agent/metrics.py), counted piece by piece.
SENT_BYTES = "modelcache_agent_peer_uploaded_bytes_total"


def peer_events(agents: list[AgentProc]) -> dict[str, int]:
    logs = [agent.log() for agent in agents]
    return {what: sum(len(re.findall(pattern, text)) for text in logs) for what, pattern in PEER_EVENTS.items()}


def counter(agent: AgentProc, name: str, port: int | None = None) -> float:
    """A counter of the agent's /metrics (0 when it has no sample, or did not answer); ``port``:
    its metrics port if known (``agent.port`` reads the agent's whole log to find it)."""
    if port is None:
        _, text = agent.get("/metrics")
    else:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return 0.0
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def start_profile(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """A profiler on agent ``pid`` until ``profiler.stop``. ``FLEET_PROFILER=perf``: ``perf record -g``
    at 199 Hz into ``out`` + ``.data`` (on-CPU samples only, native and kernel frames: where the
    CPU goes on a machine this loaded); else py-spy (``PY_SPY`` or on PATH) at 50 Hz into ``out``
    (collapsed stacks; its "active" threads include runnable ones waiting for a core, so on a
    loaded machine its samples are wake-ups as much as CPU), as bench/coordinator_scale.py's;
    ``FLEET_PROFILER=gil``: py-spy ``--gil``, the thread running Python only."""
    if os.environ.get("FLEET_PROFILER") == "perf":
        return subprocess.Popen(["perf", "record", "-F", "199", "-g", "-p", str(pid), "-o", f"{out}.data"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return profiler.start_py_spy(pid, out, rate=50, gil=os.environ.get("FLEET_PROFILER") == "gil")


def run(mode: str, nodes: int, kube: Kube, cp: ControlPlane, origin: S3Origin, workdir: Path,
        hashes: dict[str, str], timeout: float, idle: float = IDLE_SECONDS,
        probe_metrics: bool = False, profile: Path | None = None, profile_agents: int = 2) -> dict[str, Any]:
    names = [f"{mode}-{i}" for i in range(nodes)]
    make_group(kube, mode, label_value=mode)
    for name in names:
        make_node(kube, name, **{GROUP_LABEL: mode})
    extra: list[str] = list(AGENT_FLAGS)
    if mode == "p2p":
        extra += peer_args(peer_token(cp, workdir / "tokens"))
    else:
        extra += ["--peers", "off"]
    agents: list[AgentProc] = [start_agent(cp.kubeconfig_for("modelcache-system", "modelcache-agent"), name,
                                           workdir / mode / name, workdir / mode, *extra) for name in names]
    try:
        for agent in agents:
            wait_until(lambda a=agent: 'msg="agent running"' in a.log() or a.proc.poll() is not None, timeout=120,
                       what=f"agent {agent.node}")
            if agent.proc.poll() is not None:
                raise RuntimeError(f"agent {agent.node} exited:\n{agent.log()[-3000:]}")
        share = cpu_share()  # the agents are idle, the cache not made yet
        origin.proxy.reset_counters()
        # The agents' CPU from here on is what the transfer costs (bench/swarm_sim.py's CPU model
        # takes its per-byte costs from it); before it, each agent's start-up (imports, informers).
        cpu0 = [cpu_seconds(agent) for agent in agents]
        ports, by_name = {agent.node: agent.port for agent in agents}, {agent.node: agent for agent in agents}

        def sent_so_far(name: str) -> float:
            return counter(by_name[name], SENT_BYTES, ports[name])

        spies = []
        if profile is not None:  # the first ``profile_agents`` agents, from the cache's creation to the end
            profile.mkdir(parents=True, exist_ok=True)
            spies = [start_profile(agent.proc.pid, profile / f"{agent.node}.txt") for agent in agents[:profile_agents]]
        t0 = time.monotonic()
        probe = LoadProbe({agent.node: agent.proc.pid for agent in agents}, t0,
                          {agent.node: c for agent, c in zip(agents, cpu0, strict=True)},
                          sent_so_far if probe_metrics else None).start()
        kube.create(LOCAL_MODEL_CACHES, {"metadata": {"name": f"llm-{mode}"}, "spec": {
            "sourceModelUri": origin.uri, "modelSize": str(origin.size), "nodeGroups": [mode],
            "storage": {"key": "fleet"}}})

        def states() -> dict[str, str]:
            out = {}
            for name in names:
                obj = kube.get_or_none(LOCAL_MODEL_NODES, name) or {}
                out[name] = ((obj.get("status") or {}).get("modelStatus") or {}).get(f"llm-{mode}", "")
            return out

        deadline = t0 + timeout
        timeline: list[tuple[float, int]] = []
        while True:
            timeline.append((round(time.monotonic() - t0, 1), origin.origin_bytes()))
            now = states()
            if all(s == "ModelDownloaded" for s in now.values()):
                break
            if time.monotonic() > deadline:
                probe.stop()
                raise TimeoutError(f"{mode}: not all Downloaded after {timeout:.0f}s: {now}")
            time.sleep(0.1)
        seconds = time.monotonic() - t0
        cpu = [cpu_seconds(agent) for agent in agents]
        for spy in spies:
            profiler.stop(spy)
        during = probe.stop()
        sent = origin.origin_bytes()
        details = {n: ((kube.get(LOCAL_MODEL_NODES, n).get("status") or {}).get("modelDetails") or {}).get(
            f"llm-{mode}", {}) for n in names}
        for agent in agents:  # verified: byte for byte against the source
            base = agent.root / "models" / origin.key
            for path, digest in hashes.items():
                with open(base / path, "rb") as f:
                    if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                        raise AssertionError(f"{agent.node}: {path} differs from the source")
        # Idle: every node holds the model; what each agent spends doing nothing, per minute.
        idle0, at = [cpu_seconds(agent) for agent in agents], time.monotonic()
        time.sleep(idle)
        idle_cpu = [(cpu_seconds(agent) - c) * 60 / max(1e-9, time.monotonic() - at) for agent, c in zip(agents, idle0,
                                                                                                    strict=True)]
        if os.environ.get("FLEET_TIMELINE"):
            print("origin MiB by second:", [(t, round(b / 2**20)) for t, b in timeline[::10]], file=sys.stderr)
        # Per agent, for bench/swarm_sim.py's CPU costs (``contention``: the agents' CPU over the
        # quiet cost of their work): its CPU while transferring, the bytes it sent, the polls it answered;
        # and its memory (resident now, and at its peak).
        agent_rows = {}
        for agent, before, after, quiet in zip(agents, cpu0, cpu, idle_cpu, strict=True):
            rss, peak = rss_mib(agent)
            agent_rows[agent.node] = {
                "cpu_seconds": round(after - before, 2), "idle_cpu_seconds_per_minute": round(quiet, 3),
                "sent_bytes": int(counter(agent, SENT_BYTES)),
                "polls_answered": int(counter(agent, "modelcache_agent_peer_polls_answered_total")),
                "rss_mib": rss, "peak_rss_mib": peak}
        return {"seconds": seconds, "origin_bytes": sent, "agent_cpu_seconds": round(sum(cpu), 1),
                "agent_cpu_seconds_transfer": round(sum(cpu) - sum(cpu0), 2), "cpu_share": share,
                "cpu_share_during": during, "agents_during": probe.series(), "agents": agent_rows,
                "peer_events": peer_events(agents),
                "per_node": {n: [d.get("bytesFromOrigin"), d.get("bytesFromPeers")] for n, d in details.items()}}
    finally:
        for agent in agents:
            agent.stop()
        for agent in agents:
            shutil.rmtree(agent.root, ignore_errors=True)


def measure(cp: ControlPlane, kube: Kube, s3: Any, bucket: str, proxy: FaultProxy, nodes: int, size: int,
            rate: int, modes: list[str], workdir: Path, timeout: float,
            keys: tuple[str, str] = ("fleet", "fleet"),
            idle: float = IDLE_SECONDS, probe_metrics: bool = False, profile: Path | None = None,
            profile_agents: int = 2) -> tuple[S3Origin, dict[str, dict[str, Any]]]:
    """The runs of ``modes`` on a control plane with deploy/ applied: the model uploaded to
    ``bucket`` (reached through ``proxy``, throttled to ``rate``), the coordinator started as its
    ServiceAccount; ``keys``: the S3 access and secret key the agents use; ``idle``: seconds each
    agent's CPU is measured once the model is everywhere; ``probe_metrics``: read each agent's bytes
    sent beside every probe sample too (``--probe-metrics``); ``profile``: a folder for py-spy's
    samples of the first ``profile_agents`` agents of each run (``--profile``). Returns the origin and
    each mode's result (tests/test_fleet_bench.py runs it small)."""
    files = model_files(size, 4)
    upload_model(s3, bucket, "llm", files)
    hashes = {p: hashlib.sha256(b).hexdigest() for p, b in files.items()}
    origin = S3Origin(bucket, "llm", proxy, files)
    del files
    storage_secret(kube, proxy.base_url, *keys)
    proxy.set_rate_limit(rate)
    coord_cfg = Config(kubeconfig=str(cp.kubeconfig_for("modelcache-system", "modelcache-coordinator")),
                       leader_election=False, host="127.0.0.1", port=free_port(), watch_timeout=600)
    coordinator = Coordinator(coord_cfg, Kube(load_api_client(coord_cfg.kubeconfig))).start()
    try:
        wait_until(coordinator.controllers_running.is_set, timeout=60, what="coordinator")
        results: dict[str, dict[str, Any]] = {}
        for mode in modes:
            n = 1 if mode == "single" else nodes
            print(f"{mode}: {n} node(s) ...", file=sys.stderr, flush=True)
            results[mode] = run(mode, n, kube, cp, origin, workdir, hashes, timeout, idle, probe_metrics,
                                None if profile is None else profile / mode, profile_agents)
            print(f"{mode}: {results[mode]}", file=sys.stderr, flush=True)
    finally:
        coordinator.stop()
    return origin, results


def summary(nodes: int, model: int, rate: int, results: dict[str, dict[str, Any]],
            load_start: list[float]) -> dict[str, Any]:
    """What ``--json`` writes (the issue's keys, plus the origin rate and the load averages)."""
    def of(mode: str, what: str) -> Any:
        return results.get(mode, {}).get(what)

    peer_bytes = sum(p or 0 for _, p in (of("p2p", "per_node") or {}).values()) if "p2p" in results else None
    return {"nodes": nodes, "model_bytes": model, "origin_rate": rate,
            "origin_bytes_p2p": of("p2p", "origin_bytes"), "origin_bytes_direct": of("direct", "origin_bytes"),
            "seconds_p2p": _round(of("p2p", "seconds")), "seconds_direct": _round(of("direct", "seconds")),
            "seconds_single": _round(of("single", "seconds")),
            # What bench/swarm_sim.py's CPU model needs: the agents' CPU while they transferred, the
            # bytes they took from peers, the machine's cores.
            "peer_bytes_p2p": peer_bytes,
            **{f"agent_cpu_seconds_{m}": of(m, "agent_cpu_seconds_transfer") for m in results},
            **{f"cpu_share_{m}": of(m, "cpu_share") for m in results},
            # The probe repeated during each run: [seconds since the cache was made, a core's share,
            # the agents' runnable threads]; and each agent's CPU, bytes sent, polls answered, memory.
            **{f"cpu_share_during_{m}": of(m, "cpu_share_during") for m in results},
            # Beside each of those samples, each agent's CPU-s so far at the probe's start and end,
            # and the bytes it sent by the end (the module's docstring).
            **{f"agents_during_{m}": of(m, "agents_during") for m in results},
            **{f"peer_events_{m}": of(m, "peer_events") for m in results},
            **{f"agents_{m}": {n: {**row, "from_origin": (of(m, "per_node") or {}).get(n, [0, 0])[0],
                                   "from_peers": (of(m, "per_node") or {}).get(n, [0, 0])[1]}
                               for n, row in (of(m, "agents") or {}).items()} for m in results},
            "cpus": os.cpu_count(),
            "load_average_start": load_start, "load_average": [round(x, 1) for x in os.getloadavg()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--size", default="256Mi", help="model size (a config and four shards)")
    ap.add_argument("--origin-rate", default="16Mi", help="bytes per second the origin sends, in all")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--modes", default="p2p,direct,single", help="which runs (comma-separated)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (agent logs) and print its path")
    ap.add_argument("--probe-metrics", action="store_true",
                    help="also read every agent's bytes sent from its /metrics after each probe sample (slows the "
                         "probe's cadence: 0.01-1.37 s a sample at 8 agents, bench/fleet-8-stop40.json)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="profile the first --profile-agents agents of each run, from the cache's creation until "
                         "every node holds the model, into DIR/<mode>/<agent>.txt: py-spy (PY_SPY or on PATH; "
                         "collapsed stacks), or with FLEET_PROFILER=perf perf record -g (<agent>.txt.data)")
    ap.add_argument("--profile-agents", type=int, default=2)
    args = ap.parse_args()
    size, rate = parse_size(args.size), parse_size(args.origin_rate)
    if not size or not rate:
        ap.error("--size and --origin-rate take quantities like 256Mi, 16Mi")
    load_start = [round(x, 1) for x in os.getloadavg()]  # the machine is shared: say how loaded it was

    workdir = Path(tempfile.mkdtemp(prefix="fleet-", dir=REPO / ".work" if (REPO / ".work").is_dir() else None))
    cp = ControlPlane(workdir / "cluster").start()
    moto, endpoint = start_moto(workdir)
    proxy = FaultProxy(("127.0.0.1", urlsplit(endpoint).port or 0))
    try:
        apply_manifests(cp)
        kube = Kube(load_api_client(str(cp.kubeconfig)))
        import boto3

        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="fleet",
                          aws_secret_access_key="fleet")
        s3.create_bucket(Bucket="models")
        origin, results = measure(cp, kube, s3, "models", proxy, args.nodes, size, rate, args.modes.split(","),
                                  workdir, args.timeout, probe_metrics=args.probe_metrics, profile=args.profile,
                                  profile_agents=args.profile_agents)
    finally:
        proxy.close()
        stop_process(moto)
        cp.stop()
        if args.keep:
            print(f"work folder kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    model = origin.size
    out = summary(args.nodes, model, rate, results, load_start)
    single = out["seconds_single"]
    print(f"{args.nodes} nodes, model {model / 2**20:.0f} MiB (config + 4 shards), origin {rate / 2**20:.0f} MiB/s, "
          f"load average (1/5/15 min) {load_start} at start, {out['load_average']} at the end")
    print("| run | nodes | seconds to all Downloaded | x one node alone | origin bytes | x model size |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in ("p2p", "direct", "single"):
        r = results.get(mode)
        if r is None:
            continue
        ratio = f"{r['seconds'] / single:.2f}" if single else "-"
        print(f"| {mode} | {1 if mode == 'single' else args.nodes} | {r['seconds']:.1f} | {ratio} | "
              f"{r['origin_bytes']} | {r['origin_bytes'] / model:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


if __name__ == "__main__":
    main()
