"""Small helpers shared by the test fixtures: ports, readiness waits, tool lookup."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require(condition: bool, what: str) -> None:
    """Skip locally when a server or tool is missing; in CI that is a failure, never a skip."""
    if condition:
        return
    msg = f"{what} is not available (run `make test-deps`)"
    if IN_CI:
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def require_tool(name: str, *extra_dirs: str) -> str:
    path = shutil.which(name, path=os.pathsep.join([*extra_dirs, os.environ.get("PATH", "")]))
    require(path is not None, f"'{name}'")
    assert path is not None
    return path


def wait_until(check: Callable[[], bool], timeout: float = 20.0, what: str = "server") -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout}s (last error: {last})")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
