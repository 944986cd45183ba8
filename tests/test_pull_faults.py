"""Pulls through a faulty network, against failing servers and onto failing disks (issue 2).

Every pull must end with the model verified under ``models/`` or with one clear error and
nothing under ``models/`` for it: never a silently wrong or partial file.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelcache.engine.transfer import TransferOptions
from modelcache.errors import IntegrityError, ModelcacheError, StoreError, TransientError
from modelcache.pull import pull
from modelcache.sources.credentials import Settings
from modelcache.sources.uri import storage_key
from tests.faultproxy import Fault, FaultProxy
from tests.fixtures.http import NginxServer
from tests.helpers import free_port, mounted_tmpfs, wait_until
from tests.pull_helpers import (
    MiB,
    assert_store_correct,
    model_dir,
    one_error_line,
    popen_cli,
    run_cli,
    sha256,
)

SIZE = 6 * MiB + 12345  # six full chunks and a short one
FAST = TransferOptions(workers=3, chunk_size=MiB, max_attempts=5, backoff_initial=0.02, backoff_max=0.1,
                       stall_timeout=1.0)


def settings(**env: str) -> Settings:
    return Settings.from_env(env)


@pytest.fixture
def weights(nginx: NginxServer) -> bytes:
    nginx.write("m/w.bin", SIZE, seed=3)
    return (nginx.docroot / "m/w.bin").read_bytes()


def pull_ok(uri: str, root: Path, data: bytes, options: TransferOptions = FAST, **env: str) -> None:
    res = pull(uri, root=root, settings=settings(**env), options=options)
    assert not res.cached
    assert_store_correct(root, {uri: {"w.bin": data}}, must_have={uri})
    assert res.path == model_dir(root, uri)


def pull_fails(uri: str, root: Path, exc_type: type[BaseException] = ModelcacheError,
               options: TransferOptions = FAST) -> str:
    """The pull raises ``exc_type`` with one line naming the URL (or at least the file), and publishes nothing."""
    with pytest.raises(exc_type) as info:
        pull(uri, root=root, settings=settings(), options=options)
    msg = str(info.value)
    assert "\n" not in msg and (uri.split("#")[0] in msg or "w.bin" in msg), msg
    assert not model_dir(root, uri).exists(), "a failed pull left something under models/"
    return msg


# ---- network faults, recovered ---------------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        Fault("reset", path="/m/w.bin", nth=3),
        Fault("reset", path="/m/w.bin", nth=2, times=3, at=1000),
        Fault("truncate", path="/m/w.bin", nth=3),
        Fault("truncate", path="/m/w.bin", nth=4, at=1),
        Fault("status", path="/m/w.bin", nth=3, status=503, times=3),
        Fault("status", path="/m/w.bin", method="HEAD", status=503, times=2),
        Fault("status", path="/m/w.bin", nth=4, status=429, retry_after=0, times=1),
        Fault("stall", path="/m/w.bin", nth=3, stall_seconds=8),
    ],
    ids=["reset", "reset-x3", "truncate", "truncate-at-1", "503-x3", "503-on-HEAD", "429", "stall"],
)
def test_transient_fault_is_retried_to_a_correct_model(
    fault_proxy: FaultProxy, weights: bytes, tmp_path: Path, fault: Fault
) -> None:
    fault_proxy.add(fault)
    uri = fault_proxy.url("m/w.bin")
    t0 = time.monotonic()
    pull_ok(uri, tmp_path / "root", weights)
    assert fault.applied == fault.times, f"the fault fired {fault.applied} times, not {fault.times}"
    if fault.kind == "stall":
        # Aborted by the stall timeout (1 s) and retried, long before the 8 s stall ended.
        assert time.monotonic() - t0 < 6


def test_every_body_cut_short_still_completes_by_resuming_mid_chunk(
    fault_proxy: FaultProxy, weights: bytes, tmp_path: Path
) -> None:
    # Every ranged body is cut after 300 KB: each retry asks only for the rest of its chunk.
    fault = fault_proxy.add(Fault("truncate", path="/m/w.bin", nth=3, times=None, at=300_000))
    pull_ok(fault_proxy.url("m/w.bin"), tmp_path / "root", weights)
    assert fault.applied > 7
    # Nothing received was fetched twice (the 1 is the Range probe's byte).
    assert fault_proxy.bytes_sent["/m/w.bin"] == SIZE + 1


@pytest.mark.parametrize("kind", ["reset", "truncate"])
def test_fault_on_a_server_without_range_restarts_the_stream(
    nginx: NginxServer, weights: bytes, tmp_path: Path, kind: str
) -> None:
    with FaultProxy(("127.0.0.1", nginx.ports["norange"])) as proxy:
        # Request 1 is the Range probe (answered whole); request 2 is the stream to break.
        fault = proxy.add(Fault(kind, path="/m/w.bin", nth=2, at=SIZE // 3))
        uri = proxy.url("m/w.bin")
        pull_ok(uri, tmp_path / "root", weights)
        assert fault.applied == 1


# ---- network faults that never stop: clear errors, nothing published -----------------------


@pytest.mark.parametrize("kind", ["reset", "truncate", "status", "stall"])
def test_persistent_fault_fails_clearly_and_is_resumable(
    fault_proxy: FaultProxy, weights: bytes, tmp_path: Path, kind: str
) -> None:
    # From the third request on (after HEAD and the Range probe), every body breaks before its first
    # byte: a retry that resumes mid-chunk could otherwise make progress and rightly succeed.
    fault = fault_proxy.add(Fault(kind, path="/m/w.bin", nth=3, times=None, at=0, stall_seconds=3))
    uri = fault_proxy.url("m/w.bin")
    root = tmp_path / "root"
    opts = TransferOptions(workers=2, chunk_size=MiB, max_attempts=3, backoff_initial=0.02, backoff_max=0.05,
                           stall_timeout=0.5)
    msg = pull_fails(uri, root, TransientError, opts)
    assert fault.applied >= opts.max_attempts
    if kind == "status":
        assert "503" in msg
    # The network heals: the next pull completes from what was staged.
    fault_proxy.clear()
    pull_ok(uri, root, weights)


def test_cli_persistent_fault_ends_with_one_error_line(fault_proxy: FaultProxy, weights: bytes, tmp_path: Path) -> None:
    fault_proxy.add(Fault("status", path="/m/w.bin", nth=3, times=None, status=503))
    uri = fault_proxy.url("m/w.bin")
    root = tmp_path / "root"
    r = run_cli("pull", uri, "--root", str(root), "--chunk-size", "1M", "--max-attempts", "2", "--progress", "none")
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and uri in errors[0] and "503" in errors[0], r.stderr
    assert r.stderr.strip().splitlines()[-1] == errors[0]
    assert not model_dir(root, uri).exists()


# ---- a flipped byte is caught by a checksum ----------------------------------------------------


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _digest_headers(kind: str, data: bytes) -> dict[str, str]:
    return {
        "repr-digest": {"Repr-Digest": f"sha-256=:{_b64(hashlib.sha256(data).digest())}:"},
        "digest": {"Digest": f"SHA-256={_b64(hashlib.sha256(data).digest())}"},
        "content-md5": {"Content-MD5": _b64(hashlib.md5(data).digest())},
        "pinned": {},
    }[kind]


@pytest.mark.parametrize("kind", ["repr-digest", "digest", "content-md5", "pinned"])
def test_flipped_byte_is_caught_refetched_or_refused(
    fault_proxy: FaultProxy, nginx: NginxServer, weights: bytes, tmp_path: Path, kind: str
) -> None:
    if kind != "pinned":
        nginx.set_headers("m/w.bin", _digest_headers(kind, weights))
    uri = fault_proxy.url("m/w.bin") + (f"#sha256={sha256(weights)}" if kind == "pinned" else "")
    root = tmp_path / "root"

    # Once: the engine notices the mismatch and fetches again; the published bytes are right.
    once = fault_proxy.add(Fault("flip", path="/m/w.bin", file_offset=3 * MiB + 77))
    pull_ok(uri, root, weights)
    assert once.applied == 1

    # Every time: the pull fails with an integrity error and publishes nothing.
    shutil.rmtree(root)
    fault_proxy.clear()
    always = fault_proxy.add(Fault("flip", path="/m/w.bin", file_offset=5 * MiB + 3, times=None))
    msg = pull_fails(uri, root, IntegrityError)
    assert always.applied >= 2
    assert "w.bin" in msg


def test_wrong_pin_is_refused(fault_proxy: FaultProxy, weights: bytes, tmp_path: Path) -> None:
    uri = fault_proxy.url("m/w.bin") + "#sha256=" + sha256(weights[:-1] + b"x")
    pull_fails(uri, tmp_path / "root", IntegrityError)


# ---- server answers: one line naming the URL and the cause -------------------------------------


def _cli_error(uri: str, root: Path, env: dict[str, str] | None = None) -> str:
    r = run_cli("pull", uri, "--root", str(root), "--chunk-size", "1M", env=env)
    assert r.returncode != 0
    line = one_error_line(r.stderr)
    assert uri in line, line
    assert not model_dir(root, uri).exists()
    return line


def test_cli_errors_name_url_and_cause(nginx: NginxServer, weights: bytes, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert "404" in _cli_error(nginx.url("m/missing.bin"), root)
    assert "401" in _cli_error(nginx.url("auth/m/w.bin"), root)
    assert "403" in _cli_error(nginx.url("status/403/w.bin"), root)
    dead = f"http://127.0.0.1:{free_port()}/m/w.bin"
    assert "connection refused" in _cli_error(dead, root)
    tls = _cli_error(nginx.url("m/w.bin", "https"), root)
    assert "TLS" in tls or "certificate" in tls


def test_cli_host_headers_and_custom_ca(nginx: NginxServer, weights: bytes, tmp_path: Path) -> None:
    name, value = nginx.auth_header
    root = tmp_path / "root"
    uri = nginx.url("auth/m/w.bin")
    r = run_cli("pull", uri, "--root", str(root), env={"127.0.0.1-headers": f'{{"{name}": "{value}"}}'})
    assert r.returncode == 0, r.stderr
    assert value not in r.stderr + r.stdout, "a request header value was printed"
    https = nginx.url("m/w.bin", "https")
    r = run_cli("pull", https, "--root", str(root), env={"MODELCACHE_CA_BUNDLE": str(nginx.ca_path)})
    assert r.returncode == 0, r.stderr
    assert_store_correct(root, {uri: {"w.bin": weights}, https: {"w.bin": weights}}, must_have={uri, https})


# ---- disks that refuse ------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 160 MiB tmpfs (root only); elsewhere the test is skipped locally, failed in CI."""
    with mounted_tmpfs(tmp_path / "fs", "size=160m") as mnt:
        yield mnt


def test_out_of_space_is_a_clear_error_and_other_models_stay(
    nginx: NginxServer, weights: bytes, small_fs: Path
) -> None:
    small = nginx.url("m/w.bin")
    assert run_cli("pull", small, "--root", str(small_fs)).returncode == 0
    nginx.write("m/big.bin", 120 * MiB, seed=9)
    big = nginx.url("m/big.bin")
    r = run_cli("pull", big, "--root", str(small_fs))
    assert r.returncode != 0
    line = one_error_line(r.stderr)
    assert big in line and "space" in line.lower(), line
    assert_store_correct(small_fs, {small: {"w.bin": weights}}, must_have={small})
    assert run_cli("verify", "--root", str(small_fs)).returncode == 0


def test_read_only_store_is_a_clear_error_and_other_models_stay(
    nginx: NginxServer, weights: bytes, small_fs: Path
) -> None:
    first = nginx.url("m/w.bin")
    assert run_cli("pull", first, "--root", str(small_fs)).returncode == 0
    nginx.write("m/other.bin", 2 * MiB, seed=4)
    other = nginx.url("m/other.bin")
    assert subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True).returncode == 0
    r = run_cli("pull", other, "--root", str(small_fs))
    assert r.returncode != 0
    line = one_error_line(r.stderr)
    assert "read-only" in line.lower() or "cannot write" in line.lower(), line
    assert_store_correct(small_fs, {first: {"w.bin": weights}}, must_have={first})
    r = run_cli("verify", "--root", str(small_fs))
    assert r.returncode == 0, r.stdout + r.stderr
    hit = run_cli("pull", first, "--root", str(small_fs))  # a cache hit needs no write
    assert hit.returncode == 0 and "cached" in hit.stderr, hit.stderr


def test_enospc_while_writing_fails_clearly_then_resumes(
    fault_proxy: FaultProxy, weights: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC in the middle of the data (a disk filled by someone else), faked at our write layer."""
    from modelcache.store import diskio

    real = diskio.FileWriter._pwrite_all
    calls = {"n": 0}

    def failing(fd: int, data: memoryview, offset: int) -> None:
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, offset)

    root = tmp_path / "root"
    other_uri = fault_proxy.url("m/w.bin") + "#sha256=" + sha256(weights)
    pull_ok(other_uri, root, weights)  # a model already in the store
    uri = fault_proxy.url("m/w.bin")
    monkeypatch.setattr(diskio.FileWriter, "_pwrite_all", staticmethod(failing))
    with pytest.raises(StoreError) as info:
        pull(uri, root=root, settings=settings(), options=FAST)
    msg = str(info.value)
    assert "\n" not in msg and ("space" in msg.lower()), msg
    assert not model_dir(root, uri).exists()
    assert_store_correct(root, {other_uri: {"w.bin": weights}}, must_have={other_uri})
    monkeypatch.setattr(diskio.FileWriter, "_pwrite_all", staticmethod(real))
    before = fault_proxy.bytes_sent["/m/w.bin"]
    pull(uri, root=root, settings=settings(), options=FAST)
    assert_store_correct(root, {other_uri: {"w.bin": weights}, uri: {"w.bin": weights}}, must_have={uri, other_uri})
    # Resumed: the chunks written before the failure were not fetched again.
    assert fault_proxy.bytes_sent["/m/w.bin"] - before < SIZE


# ---- two pulls of one model at once -------------------------------------------------------------


def test_concurrent_pulls_of_one_uri_download_once(
    nginx: NginxServer, fault_proxy: FaultProxy, weights: bytes, tmp_path: Path
) -> None:
    uri = fault_proxy.url("m/w.bin")
    root = tmp_path / "root"
    args = ("pull", uri, "--root", str(root), "--json", "--chunk-size", "1M", "--progress", "none")
    fault_proxy.pause()  # the first pull starts its download and is held there
    first = popen_cli(*args)
    # HEAD passes; the Range probe is held: the first pull holds the model lock from here on.
    wait_until(lambda: fault_proxy.requests["/m/w.bin"] >= 2 or first.poll() is not None, what="first pull")
    second = popen_cli(*args)
    time.sleep(1.0)  # the second pull is up and waiting for the model's lock
    assert first.poll() is None and second.poll() is None
    fault_proxy.resume()
    outs = [p.communicate(timeout=60) for p in (first, second)]
    for p, (_out, err) in zip((first, second), outs, strict=True):
        assert p.returncode == 0, err
    assert_store_correct(root, {uri: {"w.bin": weights}}, must_have={uri})
    # One download in nginx's log: the body bytes of every GET but the 1-byte Range probe add up to one copy.
    body = [e for e in nginx.requests_for("m/w.bin") if e.range != "bytes=0-0"]
    assert sum(e.bytes_sent for e in body) == SIZE, body
    assert len(nginx.requests_for("m/w.bin", method="HEAD")) == 1
    assert ['"cached": true' in out for out, _ in outs] == [False, True]


def test_concurrent_library_pulls_in_threads(fault_proxy: FaultProxy, weights: bytes, tmp_path: Path) -> None:
    fault_proxy.set_rate_limit(16 * MiB)
    uri = fault_proxy.url("m/w.bin")
    root = tmp_path / "root"
    results: list[object] = []

    def run() -> None:
        try:
            results.append(pull(uri, root=root, settings=settings(), options=FAST))
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(not isinstance(r, BaseException) for r in results), results
    assert sorted(r.cached for r in results) == [False, True, True]  # type: ignore[attr-defined]
    assert fault_proxy.bytes_sent["/m/w.bin"] - fault_proxy.requests["/m/w.bin"] <= SIZE
    assert storage_key(uri) in os.listdir(root / "models")

