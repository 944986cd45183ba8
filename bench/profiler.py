"""A sampling profiler attached to a running process for part of a benchmark (shared by the
benchmarks): started on a pid, stopped with SIGINT, on which py-spy and perf write their output."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def start_py_spy(pid: int, out: Path, rate: int, gil: bool = False) -> subprocess.Popen[bytes]:
    """py-spy (``PY_SPY`` or on PATH) sampling ``pid`` at ``rate`` Hz into ``out`` (collapsed
    stacks). Its "active" threads include runnable ones waiting for a core, and threads blocked in
    SSL reads: on a loaded machine its samples are waits as much as CPU. ``gil``: only the thread
    holding the GIL is sampled, the process's Python CPU (bench/coordinator_scale.py's sixth round)."""
    spy = os.environ.get("PY_SPY", "py-spy")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", str(rate), "--nonblocking",
                             *(["--gil"] if gil else []), "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(profiler: subprocess.Popen[bytes]) -> None:
    profiler.send_signal(signal.SIGINT)  # py-spy and perf write their output on SIGINT
    try:
        profiler.wait(60)
    except subprocess.TimeoutExpired:
        profiler.kill()
        profiler.wait()
