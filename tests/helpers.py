"""Small helpers shared by the test fixtures: ports, readiness waits, tool lookup."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

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


def venv_bin(name: str) -> Path:
    """A console script of the venv the tests run in (moto_server, gcp-storage-emulator, ...)."""
    return Path(sys.executable).parent / name


def unique(prefix: str) -> str:
    """A name no other test of the session uses (buckets, containers, users)."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def start_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A server process in a session of its own, its output to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_server(proc: subprocess.Popen[bytes], port: int) -> None:
    """Stop ``proc`` and wait (up to 5 s) for its port to close, so it can be taken again."""
    stop_process(proc)
    deadline = time.monotonic() + 5
    while port_open(port) and time.monotonic() < deadline:
        time.sleep(0.1)


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


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A small file system of our own at ``path`` (``size=64m``, ``ro``, ...), unmounted after.
    Needs root; without it the test is skipped (a failure in CI)."""
    path.mkdir(parents=True, exist_ok=True)
    ok = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"mode=0755,{options}", "tmpfs", str(path)], capture_output=True
    ).returncode == 0
    require(ok, f"mounting a tmpfs with {options} (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill_up(path: Path) -> Path:
    """Write ``path`` until its file system has not one byte left; returns it (delete to free)."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            block = b"\0" * size
            try:
                while True:
                    f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return path


def self_trusting_pair(folder: Path, *hosts: str) -> tuple[Path, Path]:
    """A server certificate for ``hosts`` from a throwaway trustme CA: (chain, key). The chain
    file holds the leaf and the CA, so a server serves it whole and a client may take the same
    file as its CA bundle."""
    import trustme

    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="modelcache test CA")
    leaf = ca.issue_cert(*hosts)
    chain, key = folder / "tls.crt", folder / "tls.key"
    chain.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems) + ca.cert_pem.bytes())
    leaf.private_key_pem.write_to_path(str(key))
    return chain, key


def load_script(relpath: str, name: str) -> ModuleType:
    """A script of the repo that is not in a package (bench/, image/) as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
