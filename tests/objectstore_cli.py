"""Running ``modelcache pull`` against the object stores, and the record of every output for
the final grep for secrets (test_objectstore_pull.test_zz_no_secret_in_any_output)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests import forked
from tests.pull_helpers import one_error_line

CHUNK = 256 * 1024
#: Every CLI run's output, for the final grep for secrets.
CAPTURED: list[str] = []
SECRETS: set[str] = set()


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """The test process's env minus every credential variable, plus ``extra``."""
    drop = ("AWS_", "S3_", "AZURE_", "AZ_", "GOOGLE_", "STORAGE_", "MODELCACHE_AZURE", "awsAnonymous")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return env | extra


def pull(root: Path, uri: str, env: dict[str, str], *more: str) -> subprocess.CompletedProcess[str]:
    args = [
        "pull",
        uri,
        "--root",
        str(root),
        "--chunk-size",
        str(CHUNK),
        "--workers",
        "4",
        "--progress",
        "plain",
        "--progress-interval",
        "0.2",
        *more,
    ]
    r = forked.run_module("modelcache", *args, env=clean_env(env), timeout=120)  # tests/forked.py
    record(r.stdout + r.stderr)
    return r


def record(output: str) -> None:
    CAPTURED.append(output)
    for s in SECRETS:
        assert s not in output, "a secret value appeared in modelcache's output"


def errors_only(stderr: str) -> str:
    """The CLI's error report (progress lines are interleaved on stderr with --progress plain)."""
    return "\n".join(ln for ln in stderr.splitlines() if ln.startswith("error:") or "Error" in ln.split(":")[0])


def fails_with(root: Path, uri: str, env: dict[str, str], *needles: str) -> str:
    r = pull(root, uri, env)
    assert r.returncode != 0
    line = one_error_line(errors_only(r.stderr))
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    return line
