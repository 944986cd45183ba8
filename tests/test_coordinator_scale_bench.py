"""bench/coordinator_scale.py, run small on a control plane of its own: it must keep working as the
coordinator changes, and its baseline must stay what it claims (exactly one LocalModelNode write
and one label patch per node). Nothing here is timed: the bench's own run (README) measures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.cluster import start_control_plane
from tests.helpers import load_script

pytestmark = pytest.mark.timeout(900)

#: The keys the issue's --json names.
ISSUE_KEYS = ("nodes", "converge_seconds", "baseline_seconds", "requests_per_node", "peak_rss_mib", "quiet_requests")


def test_the_coordinator_scale_bench_converges_against_its_baseline_and_reports_the_issues_keys(
        tmp_path: Path, kube_binaries: Path) -> None:  # kube_binaries: tiered 'cluster'
    bench = load_script("bench/coordinator_scale.py", "coordinator_scale_bench")
    cp = start_control_plane(tmp_path / "cluster", baseline=False, apiserver_args=("--profiling=true",))
    try:
        out = bench.measure(cp, nodes=30, groups=3, caches=6, workers=4, quiet=3, timeout=600, workdir=tmp_path,
                            api_profile=lambda phase: bench.ApiserverProfile(cp, tmp_path / f"{phase}.pprof", 2))
    finally:
        cp.stop()
    # --apiserver-profile: each phase's API-server CPU profile, as Go's pprof writes it (gzip)
    for phase in ("baseline", "coordinator"):
        assert "apiserver_profile_error" not in out[phase]
        assert (tmp_path / f"{phase}.pprof").read_bytes()[:2] == b"\x1f\x8b"
    assert set(ISSUE_KEYS) <= set(out) and out["nodes"] == 30
    assert out["baseline"]["requests"] == {"POST": 30, "PATCH": 30}  # the fewest writes: one of each per node
    assert out["baseline_requests_per_node"] == 2.0
    writes = out["coordinator"]["writes_to_converge"]
    assert writes["LocalModelNode create"] == 30 and writes["Node patch"] >= 30
    assert out["converge_seconds"] > 0 and out["baseline_seconds"] > 0 and out["peak_rss_mib"] > 0
    assert out["quiet_requests"] == 0  # nothing at rest
    assert 2.0 <= out["requests_per_node"] < 4.0


def test_the_bench_creates_the_caches_round_robin_or_group_by_group() -> None:
    bench = load_script("bench/coordinator_scale.py", "coordinator_scale_bench")
    assert bench.creation_order(6, 3, by_group=False) == [0, 1, 2, 3, 4, 5]
    assert bench.creation_order(6, 3, by_group=True) == [0, 3, 1, 4, 2, 5]  # g0's, g1's, g2's
