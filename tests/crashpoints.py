"""Run the ``modelcache`` CLI and kill -9 it exactly at a step of a publish.

``python -m tests.crashpoints STEP[:N] ARGS...`` runs ``modelcache ARGS...`` and delivers SIGKILL
to itself the N-th time (default: the first) a publish reaches STEP (``modelcache.store.steps.PUBLISH_STEPS``):
the windows a kill at a random moment almost never hits. With ``MODELCACHE_STEPS_LOG=<file>``
every step reached is appended to that file (to check that a flow passes through a step at all).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests import forked
from tests.helpers import REPO


def _install(at: str, nth: int, log: str | None) -> None:
    import modelcache.store.steps as store_steps

    steps = store_steps.PUBLISH_STEPS + store_steps.REPAIR_STEPS
    assert at == "none" or at in steps, f"{at} is not a publish step {steps}"
    seen = 0

    def step(name: str) -> None:
        nonlocal seen
        if log:
            with open(log, "a") as f:
                f.write(name + "\n")
        if name == at:
            seen += 1
            if seen == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    store_steps.reached = step


def run(step: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
        ) -> subprocess.CompletedProcess[str]:
    """The CLI with ``args``, killed at ``step`` ("pending", "swapped:2", ...; "none": never), forked
    with the product imported (tests/forked.py)."""
    return forked.run_module("tests.crashpoints", step, *args, env={**os.environ, **(env or {})}, timeout=timeout,
                             cwd=REPO)


def popen(step: str, *args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.crashpoints", step, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, cwd=REPO)


def steps_reached(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def main() -> None:
    at, _, nth = sys.argv[1].partition(":")
    _install(at, int(nth or 1), os.environ.get("MODELCACHE_STEPS_LOG"))
    from modelcache.cli.commands import main as cli_main

    sys.argv = ["modelcache", *sys.argv[2:]]
    cli_main()


if __name__ == "__main__":
    main()
