"""kill -9 of a running ``modelcache pull``, then a rerun (issue 2).

The rerun must complete with the right bytes, fetch again less than two chunks per file that
was in flight (counted at the proxy, which sees every body byte the server sends), and at no
moment of either run may ``models/`` show a partial or wrong model.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from tests.faultproxy import FaultProxy
from tests.fixtures.http import NginxServer
from tests.pull_helpers import MiB, StoreWatcher, assert_store_correct, journaled_bytes, popen_cli, run_cli

FILES = 3
FILE_SIZE = 4 * MiB + 4096 * 3  # eight full chunks and a short one
CHUNK = 512 * 1024
RATE = 6 * MiB  # all connections together: a pull takes ~2 s, long enough to kill it anywhere
TOTAL = FILES * FILE_SIZE


@pytest.fixture
def shards(nginx: NginxServer, fault_proxy: FaultProxy) -> dict[str, dict[str, bytes]]:
    """URI -> {file name: bytes} for three shards served through the proxy."""
    out = {}
    for i in range(FILES):
        name = f"model-{i + 1:05d}-of-{FILES:05d}.safetensors"
        nginx.write(f"m/{name}", FILE_SIZE, seed=100 + i)
        out[fault_proxy.url(f"m/{name}")] = {name: (nginx.docroot / "m" / name).read_bytes()}
    return out


def pull_args(root: Path, uris: list[str]) -> list[str]:
    return ["pull", *uris, "--root", str(root), "--workers", str(FILES), "--chunk-size", str(CHUNK),
            "--progress", "none"]


def run_until(proxy: FaultProxy, proc: subprocess.Popen[str], sent_at_least: int, timeout: float = 30) -> None:
    """Wait until the proxy has delivered ``sent_at_least`` body bytes (or the pull ended)."""
    deadline = time.monotonic() + timeout
    while proxy.total_bytes_sent < sent_at_least and proc.poll() is None:
        assert time.monotonic() < deadline, "the pull made no progress"
        time.sleep(0.003)


def kill9(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    assert proc.returncode in (-signal.SIGKILL, 0), proc.returncode


def kill9_held(proxy: FaultProxy, proc: subprocess.Popen[str], root: Path, uris: list[str]) -> None:
    """Hold every body still, let the client drain its socket buffers, then kill -9 it.

    Bytes the proxy sent are then bytes the client read: what the rerun fetches again is only
    what the killed pull had read but not yet made durable. The kill waits until the client's
    journal has stopped growing (at least 0.4 s, at most 5 s), not for a fixed time: on a
    loaded machine a client may need longer to write and journal what it already read.
    """
    proxy.pause()
    deadline = time.monotonic() + 5
    last, quiet_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now_total = sum(journaled_bytes(root, u) for u in uris)
        if now_total != last:
            last, quiet_since = now_total, time.monotonic()
        elif time.monotonic() - quiet_since >= 0.4:
            break
        time.sleep(0.05)
    kill9(proc)
    proxy.resume()


def refetched(proxy: FaultProxy, uri: str) -> int:
    """Body bytes sent for ``uri`` beyond one copy of the file (the 1-byte Range probes excluded)."""
    path = "/" + uri.split("/", 3)[3]
    probes = sum(1 for r in proxy.records if r.path == path and r.range == "bytes=0-0")
    return proxy.bytes_sent[path] - probes - FILE_SIZE


@pytest.mark.parametrize("kill_at", [0.1, 0.45, 0.8, 1.0], ids=["10%", "45%", "80%", "all-bytes-sent"])
def test_kill9_then_rerun_resumes(
    fault_proxy: FaultProxy, shards: dict[str, dict[str, bytes]], tmp_path: Path, kill_at: float
) -> None:
    root = tmp_path / "root"
    uris = list(shards)
    fault_proxy.set_rate_limit(RATE)
    with StoreWatcher(root, shards) as watcher:
        proc = popen_cli(*pull_args(root, uris))
        run_until(fault_proxy, proc, int(TOTAL * kill_at))
        kill9_held(fault_proxy, proc, root, uris)
        killed_after = fault_proxy.total_bytes_sent
        fault_proxy.set_rate_limit(None)
        r = run_cli(*pull_args(root, uris))
        assert r.returncode == 0, r.stderr
    assert watcher.polls > 50 and not watcher.problems, watcher.problems
    assert_store_correct(root, shards, must_have=set(uris))
    assert killed_after < TOTAL or kill_at == 1.0, "the pull finished before it could be killed"
    for uri in uris:
        extra = refetched(fault_proxy, uri)
        assert extra < 2 * CHUNK, f"{uri}: fetched {extra} bytes again after the kill (limit {2 * CHUNK})"
        assert not (root / ".modelcache" / "staging" / storage_key(uri)).exists()
    assert run_cli("verify", "--root", str(root)).returncode == 0


def test_kill9_while_bytes_flow_then_rerun_resumes(
    fault_proxy: FaultProxy, shards: dict[str, dict[str, bytes]], tmp_path: Path
) -> None:
    """Killed mid-stream (no pause): bytes in socket buffers are lost too, so the bound is looser."""
    root = tmp_path / "root"
    uris = list(shards)
    fault_proxy.set_rate_limit(RATE)
    with StoreWatcher(root, shards) as watcher:
        proc = popen_cli(*pull_args(root, uris))
        run_until(fault_proxy, proc, TOTAL // 2)
        kill9(proc)
        killed_after = fault_proxy.total_bytes_sent
        fault_proxy.set_rate_limit(None)
        r = run_cli(*pull_args(root, uris))
        assert r.returncode == 0, r.stderr
    assert not watcher.problems, watcher.problems
    assert_store_correct(root, shards, must_have=set(uris))
    # Starting the files over would fetch all of the ~50% again; resuming loses little.
    assert sum(refetched(fault_proxy, u) for u in uris) < killed_after // 2


def test_killed_twice_then_completes(fault_proxy: FaultProxy, shards: dict[str, dict[str, bytes]],
                                     tmp_path: Path) -> None:
    root = tmp_path / "root"
    uris = list(shards)
    fault_proxy.set_rate_limit(RATE)
    with StoreWatcher(root, shards) as watcher:
        for fraction in (0.25, 0.6):
            proc = popen_cli(*pull_args(root, uris))
            run_until(fault_proxy, proc, int(TOTAL * fraction))
            kill9_held(fault_proxy, proc, root, uris)
        assert fault_proxy.total_bytes_sent < TOTAL + 2 * FILES * CHUNK
        fault_proxy.set_rate_limit(None)
        r = run_cli(*pull_args(root, uris))
        assert r.returncode == 0, r.stderr
    assert not watcher.problems, watcher.problems
    assert_store_correct(root, shards, must_have=set(uris))
    for uri in uris:
        # Two kills: at most two in-flight chunks lost per kill and file.
        assert refetched(fault_proxy, uri) < 4 * CHUNK


def test_kill9_of_one_waiting_on_the_lock_leaves_the_other_to_finish(
    fault_proxy: FaultProxy, shards: dict[str, dict[str, bytes]], tmp_path: Path
) -> None:
    """A second pull blocked on the model lock is killed; the first one is unaffected."""
    root = tmp_path / "root"
    uris = list(shards)
    fault_proxy.set_rate_limit(RATE)
    with StoreWatcher(root, shards) as watcher:
        first = popen_cli(*pull_args(root, uris))
        run_until(fault_proxy, first, TOTAL // 5)
        second = popen_cli(*pull_args(root, uris))
        time.sleep(0.5)
        kill9(second)
        _out, err = first.communicate(timeout=60)
        assert first.returncode == 0, err
    assert not watcher.problems, watcher.problems
    assert_store_correct(root, shards, must_have=set(uris))
    for uri in uris:
        assert refetched(fault_proxy, uri) == 0
