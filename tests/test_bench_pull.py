"""bench/pull_http.py end to end on a small model: the figures the README's tables come from.

Performance is never asserted here (the benchmarks print ratios against peers run side by side);
this checks that a run reports what the docs quote: CPU per GiB, peak RSS, modelcache's fixed
cost beyond its transfer, the load average, and, with ``--cpus``, that the clients ran inside
the CPU cgroup it made (and that the cgroup is gone afterwards).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.fixtures.http import _nginx_binary
from tests.helpers import REPO, require, require_tool


def _cgroups() -> set[str]:
    found: set[str] = set()
    for base in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")):
        if base.is_dir():
            found |= {p.name for p in base.iterdir() if p.name.startswith("modelcache-bench-")}
    return found


def test_a_small_run_reports_cpu_rss_fixed_cost_and_load_under_a_cpu_limit(tmp_path: Path) -> None:
    require(_nginx_binary() is not None, "nginx (Debian package `nginx`)")
    require_tool("curl")
    require(os.geteuid() == 0, "root (the CPU cgroup of --cpus)")
    before = _cgroups()
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "pull_http.py"), "--size", "16MiB", "--shards", "2", "--rounds", "1",
         "--tools", "modelcache,curl,dd", "--cpus", "1", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    limit = re.search(r"load average [\d.]+/[\d.]+/[\d.]+ before, [\d.]+/[\d.]+/[\d.]+ after; "
                      r"clients limited to 1 CPU \(cgroup quota; .* in (\d+) of (\d+) 100 ms periods\)", out)
    assert limit and int(limit.group(2)) > 0, out  # periods counted: the clients ran in the cgroup
    row = re.search(r"^\| modelcache \| (\d+) \| [^|]+ \| - \| ([\d.]+) \| (\d+) \|$", out, re.M)
    assert row and float(row.group(2)) > 0 and int(row.group(3)) > 0, out
    assert re.search(r"modelcache fixed cost \(wall beyond transfer\): median [\d.]+ s", out), out
    assert re.search(r"target CPU <= 0.4 s/GiB beyond a forced checksum: [\d.]+ (OK|MISSED)", out), out
    assert re.search(r"target modelcache >= 0.9x dd oflag=direct", out), out
    assert _cgroups() == before, "the benchmark left its CPU cgroup behind"
