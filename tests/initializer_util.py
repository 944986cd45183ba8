"""Run the storage initializer as the init container would: a subprocess with its own env."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO

#: Never inherit the developer's cloud credentials or proxies into the initializer under test.
_PASS_THROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SYSTEMROOT")


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def output(self) -> str:
        return self.out + self.err


def initializer_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: os.environ[k] for k in _PASS_THROUGH if k in os.environ}
    env["PYTHONPATH"] = str(REPO)
    env["MODELCACHE_PROGRESS_INTERVAL"] = "0.5"
    env.update(extra or {})
    return env


def initializer_cmd() -> list[str]:
    return [sys.executable, "-m", "initializer"]


def run_initializer(*args: str | Path, env: Mapping[str, str] | None = None, timeout: float = 120) -> Run:
    proc = subprocess.run(
        [*initializer_cmd(), *map(str, args)],
        env=initializer_env(env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)
