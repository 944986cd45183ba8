"""bench/fleet.py, run small on the shared control plane: it must keep working as the agent and
deploy/ change (it broke once silently when the credentials moved namespace). Nothing here is
timed: the bench's own run (README) measures; this checks what it reports and that every node of
every run ends with the model, byte for byte (the bench checks that itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.agent_util import kube_for
from tests.faultproxy import FaultProxy
from tests.helpers import load_script, stop_process, wait_until

pytestmark = pytest.mark.timeout(600)

#: The keys the issue's --json names.
ISSUE_KEYS = ("nodes", "model_bytes", "origin_bytes_p2p", "origin_bytes_direct", "seconds_p2p", "seconds_direct",
              "seconds_single")


def test_the_fleet_bench_fills_two_nodes_three_ways_and_reports_the_issues_keys(cluster, moto_s3, tmp_path: Path):
    bench = load_script("bench/fleet.py", "fleet_bench")
    proxy = FaultProxy(("127.0.0.1", urlsplit(moto_s3.endpoint).port or 0))
    bucket = moto_s3.new_bucket()
    try:
        origin, results = bench.measure(cluster.cp, kube_for(cluster), moto_s3.client(), bucket, proxy, 2, 6 << 20,
                                        4 << 20, ["p2p", "direct", "single"], tmp_path, 300,
                                        (moto_s3.access_key, moto_s3.secret_key), idle=2.0, probe_metrics=True)
    finally:
        proxy.close()
    out = bench.summary(2, origin.size, 4 << 20, results, [0.0, 0.0, 0.0])
    assert set(ISSUE_KEYS) <= set(out) and out["nodes"] == 2 and out["model_bytes"] == origin.size
    assert all(out[k] > 0 for k in ("seconds_p2p", "seconds_direct", "seconds_single"))
    assert out["origin_bytes_direct"] == 2 * origin.size  # without peers every node reads it all
    # Less than without peers. Not the 1.2x target: with the agent's own 4 MiB pieces each 1.5 MiB
    # file here is one piece, so one piece read twice while the swarm forms is a quarter of the model
    # (tests/test_agent_peers.py holds a group to 1.2x with 1 MiB pieces).
    assert origin.size <= out["origin_bytes_p2p"] < out["origin_bytes_direct"]
    for node, (from_origin, from_peers) in results["p2p"]["per_node"].items():
        assert from_origin + from_peers >= origin.size, node
    assert results["single"]["origin_bytes"] == origin.size
    # What bench/swarm_sim.py's CPU model takes: the agents' CPU while they transferred (not their
    # start-up: less than all they used), the bytes the peers sent, the machine's cores.
    for mode in ("p2p", "direct", "single"):
        assert 0 < out[f"agent_cpu_seconds_{mode}"] < results[mode]["agent_cpu_seconds"], (mode, results[mode])
    assert out["peer_bytes_p2p"] == sum(p for _, p in results["p2p"]["per_node"].values()) > 0
    assert out["cpus"] == os.cpu_count()
    # Each agent's CPU once the model is everywhere (idle), per minute (2 s of it here: a few ticks
    # of /proc's 10 ms, or none).
    for mode in ("p2p", "direct", "single"):
        assert all(row["idle_cpu_seconds_per_minute"] >= 0 for row in out[f"agents_{mode}"].values()), mode
    # Beside each probe sample, every agent's CPU so far (since the cache was made) and, with
    # probe_metrics, bytes sent: never more than its total for the run. The run's CPU is read once
    # all are Downloaded ("seconds"), so a sample that ended by then read no more; its sent bytes
    # are read after the idle period, later than any sample.
    for mode in ("p2p", "direct", "single"):
        during, agents = out[f"agents_during_{mode}"], out[f"agents_{mode}"]
        assert len(during["at"]) == len(out[f"cpu_share_during_{mode}"]) >= 1, (mode, during)
        assert set(during["cpu_seconds"]) == set(during["sent_bytes"]) == set(agents), mode
        ended = [i for i, (_, end) in enumerate(during["at"]) if end + 0.005 <= results[mode]["seconds"]]
        for name, rows in during["cpu_seconds"].items():
            assert len(rows) == len(during["at"]), (name, rows)
            assert all(rows[i][1] <= agents[name]["cpu_seconds"] + 0.01 for i in ended), (name, rows, agents[name])
            assert during["sent_bytes"][name][-1] <= agents[name]["sent_bytes"], name


def test_the_probe_records_each_agents_cpu_and_sent_bytes_beside_each_of_its_samples() -> None:
    """``LoadProbe`` on two stand-in agents, one computing and one asleep: its series has a
    reading per agent for every probe sample, at the probe's start and end, in CPU-s since the
    readings it was given, and the computing one's CPU grows while the sleeping one's does not."""
    bench = load_script("bench/fleet.py", "fleet_bench")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    asleep = subprocess.Popen(["sleep", "120"])
    reads: list[str] = []

    def sent(name: str) -> float:
        reads.append(name)
        return 1000.0 * len(reads)

    try:
        pids = {"busy": busy.pid, "asleep": asleep.pid}
        # The readings the series counts from, taken once the busy one has used some CPU already.
        wait_until(lambda: bench.pid_cpu_seconds(busy.pid) >= 0.1, timeout=60, what="CPU used before the start")
        cpu0 = {name: bench.pid_cpu_seconds(pid) for name, pid in pids.items()}
        t0 = time.monotonic()
        probe = bench.LoadProbe(pids, t0, cpu0, sent, during=0.3, every=0.5).start()
        try:
            wait_until(lambda: len(probe.samples) >= 3, timeout=60, what="three probe samples")
        finally:
            samples = probe.stop()
        busy_total = bench.pid_cpu_seconds(busy.pid) - cpu0["busy"]
    finally:
        stop_process(busy)
        stop_process(asleep)
    series = probe.series()
    n = len(samples)
    assert len(series["at"]) == n >= 3 and len(series["metrics_read_seconds"]) == n
    for (t, _, _), (start, end) in zip(samples, series["at"], strict=True):
        assert abs(start - t) <= 0.06 and start < end  # the sample's own start, seconds since t0
    for name in pids:
        rows = series["cpu_seconds"][name]
        assert len(rows) == n
        flat = [c for row in rows for c in row]
        assert flat == sorted(flat) and flat[0] >= 0, (name, rows)  # so far: never less than before
    assert series["cpu_seconds"]["asleep"][-1][1] <= 0.02  # since cpu0, not since it started
    busy_rows = series["cpu_seconds"]["busy"]
    assert 0.05 < busy_rows[-1][1] <= busy_total + 0.02, (busy_rows, busy_total)
    assert sum(end - start for start, end in busy_rows) > 0, busy_rows  # read at each window's end too
    # One /metrics read per agent after each sample, in the samples' order.
    assert series["sent_bytes"] == {"busy": [1000 * (2 * i + 1) for i in range(n)],
                                    "asleep": [1000 * (2 * i + 2) for i in range(n)]}
    # What --json writes: the series beside the probe's samples, under the run's mode.
    out = bench.summary(2, 1, 1, {"p2p": {"cpu_share_during": samples, "agents_during": series}}, [0.0, 0.0, 0.0])
    written: dict[str, Any] = json.loads(json.dumps(out))
    assert len(written["agents_during_p2p"]["at"]) == len(written["cpu_share_during_p2p"]) == n
    assert written["agents_during_p2p"]["cpu_seconds"]["busy"] == [list(row) for row in busy_rows]


def test_the_probe_without_a_metrics_reader_records_cpu_only() -> None:
    bench = load_script("bench/fleet.py", "fleet_bench")
    probe = bench.LoadProbe({"self": os.getpid()}, time.monotonic(), during=0.1, every=0.1).start()
    try:
        wait_until(lambda: len(probe.samples) >= 1, timeout=60, what="a probe sample")
    finally:
        probe.stop()
    series = probe.series()
    assert set(series) == {"at", "cpu_seconds"} and len(series["cpu_seconds"]["self"]) == len(probe.samples)
