"""Peak RSS of a running process tree, sampled from /proc (shared by the benchmarks)."""

from __future__ import annotations

import os
import threading
from pathlib import Path


class RssSampler:
    """Samples the summed VmRSS of ``pid`` and its descendants every ``interval`` seconds.

    ``wait4``'s ru_maxrss would count the benchmark's own image, which a child carries between
    fork and exec; samples of a process still showing our command line are skipped for the same
    reason.
    """

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_kib = 0
        self._own_cmdline = Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _tree(self, pid: int) -> list[int]:
        out = [pid]
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                out += [c for k in task.read_text().split() for c in self._tree(int(k))]
            except OSError:
                pass
        return out

    def _rss_kib(self, pid: int) -> int:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == self._own_cmdline:
                return 0  # forked, not yet exec'd: still our image
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, sum(self._rss_kib(p) for p in self._tree(self.pid)))
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kib
