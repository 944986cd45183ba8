"""End to end: `modelcache pull hdfs://... --root DIR` as a process of its own (tests/forked.py)
against the WebHDFS test server (namenode + datanode on real HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from tests.contract import NetworkContract, NetworkTarget, first_match, nth_match
from tests.pull_helpers import error_line, model_files, run_pull
from tests.webhdfs import WebHDFSServer
from tests.webhdfs.server import Request

BIG = os.urandom(1_300_000)  # two HDFS blocks (1 MiB in the test server), ~20 chunks at 64K
FILES = {
    "config.json": b'{"model_type": "tiny"}',
    "weights/shard-0/model.bin": BIG,
    "tokenizer/vocab.txt": b"a\nb\n" * 100,
}


@pytest.fixture
def hdfs(webhdfs: WebHDFSServer) -> WebHDFSServer:
    for rel, data in FILES.items():
        webhdfs.put(f"/models/bert/{rel}", data)
    return webhdfs


def _env(server: WebHDFSServer, tmp_path: Path, **secret: str) -> dict[str, str]:
    folder = tmp_path / "hdfscreds"
    folder.mkdir(exist_ok=True)
    for name in list(os.listdir(folder)):
        (folder / name).unlink()
    for name, value in {"HDFS_NAMENODE": server.url, **secret}.items():
        (folder / name).write_text(value)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HDFS_", "STORAGE_"))}
    env["HDFS_SECRET_DIR"] = str(folder)
    return env




def _pull(server: WebHDFSServer, tmp_path: Path, uri: str, *args: str, **secret: str) -> subprocess.CompletedProcess:
    return run_pull(uri, tmp_path / "root", "--chunk-size", "64K", *args, env=_env(server, tmp_path, **secret))


def _model(tmp_path: Path, uri: str) -> dict[str, bytes]:
    return model_files(tmp_path / "root", uri)


def _error_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    return error_line(proc, *needles, secrets=())


def test_pull_nested_multichunk_verified(hdfs: WebHDFSServer, tmp_path: Path) -> None:
    uri = "hdfs://models/bert"
    proc = _pull(hdfs, tmp_path, uri)
    assert proc.returncode == 0, proc.stderr
    assert _model(tmp_path, uri) == FILES
    manifest = json.loads((tmp_path / "root/.modelcache/manifests" / f"{storage_key(uri)}.json").read_text())
    checks = {f["path"]: f.get("checksums", {}) for f in manifest["files"]}
    assert all("hdfs-md5md5crc" in checks[p] for p in FILES), checks
    opens = [r for r in hdfs.ops("datanode") if r.op == "OPEN" and r.path.endswith("model.bin")]
    spans = sorted((int(r.params["offset"]), int(r.params["length"])) for r in opens)
    assert len(spans) > 1  # ranged requests (offset/length), not one whole-file stream
    assert spans[0][0] == 0 and sum(n for _, n in spans) == len(BIG)
    assert all(off % (64 << 10) == 0 for off, _ in spans)
    again = _pull(hdfs, tmp_path, uri)
    assert again.returncode == 0 and "cached" in again.stderr, again.stderr


def test_corrupted_byte_fails_verification(hdfs: WebHDFSServer, tmp_path: Path) -> None:
    hdfs.corrupt_reads["/models/bert/weights/shard-0/model.bin"] = 1_100_000
    uri = "webhdfs://models/bert"
    proc = _pull(hdfs, tmp_path, uri)
    _error_line(proc, "weights/shard-0/model.bin")
    assert "hdfs-md5md5crc" in proc.stderr or "checksum" in proc.stderr.lower(), proc.stderr
    assert not (tmp_path / "root/models" / storage_key(uri)).exists()


def test_error_messages(hdfs: WebHDFSServer, tmp_path: Path) -> None:
    _error_line(_pull(hdfs, tmp_path, "hdfs://models/missing"), "hdfs://models/missing", "not found")
    hdfs.required_headers = {"X-Gateway-Token": "s3cr3t-value"}
    line = _error_line(_pull(hdfs, tmp_path, "hdfs://models/bert"), "hdfs://models/bert", "authentication failed")
    assert "s3cr3t-value" not in line
    ok = _pull(hdfs, tmp_path, "hdfs://models/bert", HEADERS='{"X-Gateway-Token": "s3cr3t-value"}')
    assert ok.returncode == 0, ok.stderr
    assert "s3cr3t-value" not in ok.stderr
    hdfs.denied_paths = {"/models/other"}
    hdfs.put("/models/other/a.bin", b"a")
    _error_line(
        _pull(hdfs, tmp_path, "hdfs://models/other", HEADERS='{"X-Gateway-Token": "s3cr3t-value"}'),
        "hdfs://models/other",
        "denied",
    )


def test_rate_limited_reads_and_listing_are_retried(hdfs: WebHDFSServer, tmp_path: Path) -> None:
    """429s with Retry-After from a gateway, on the listing and on chunk reads: the pull waits and completes."""
    hdfs.fail(429, retry_after=1, count=1, when=lambda r: r.op == "LISTSTATUS")
    hdfs.fail(429, retry_after=1, count=3, when=lambda r: r.op == "OPEN" and r.node == "datanode")
    uri = "hdfs://models/bert"
    proc = _pull(hdfs, tmp_path, uri)
    assert proc.returncode == 0, proc.stderr
    assert _model(tmp_path, uri) == FILES
    opens = [r for r in hdfs.ops("datanode") if r.op == "OPEN"]
    assert len(opens) >= 3 + 3  # every file read, plus the three refused attempts


# ---- the backend contract (tests/contract.py; its resume after kill -9 replaced this module's) ----


class _WebHDFSTarget(NetworkTarget):
    """The WebHDFS test server (NameNode and DataNode): faults are its own, on the DataNode's reads."""

    def __init__(self, server: WebHDFSServer, tmp: Path) -> None:
        self.server = server
        self.tmp = tmp
        self.n = 0

    def model(self, files: dict[str, bytes]) -> str:
        self.n += 1
        for rel, data in files.items():
            self.server.put(f"/contract/m{self.n}/{rel}", data)
        return f"hdfs://contract/m{self.n}"

    def missing(self) -> str:
        return "hdfs://contract/nothing-here"

    def env(self) -> dict[str, str]:
        folder = self.tmp / "hdfscreds"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "HDFS_NAMENODE").write_text(self.server.url)
        return {"HDFS_SECRET_DIR": str(folder)}

    def _path(self, uri: str, path: str) -> str:
        return f"/{uri.removeprefix('hdfs://')}/{path}"

    def replace(self, uri: str, path: str, data: bytes) -> None:
        self.server.put(self._path(uri, path), data)

    def _reads(self, uri: str, path: str) -> Callable[[Request], bool]:
        return lambda r: r.node == "datanode" and r.op == "OPEN" and r.path.endswith(self._path(uri, path))

    def on_read(self, uri: str, path: str, nth: int, action: Callable[[], None]) -> None:
        seen = nth_match(self._reads(uri, path), nth)

        def when(r: Request) -> bool:  # never answers: only watches
            if seen(r):
                action()
            return False

        self.server.fail(200, count=1, when=when)

    def fail_read(self, uri: str, path: str, status: int, retry_after: int) -> Callable[[], int]:
        when, hits = first_match(self._reads(uri, path))
        self.server.fail(status, count=1, retry_after=retry_after, when=when)
        return hits

    def flip_read(self, uri: str, path: str) -> Callable[[], int]:
        self.server.corrupt_reads[self._path(uri, path)] = 0
        self.server.corrupt_once.add(self._path(uri, path))
        return lambda: self.server.flipped

    def throttle(self, bytes_per_s: int | None) -> None:
        self.server.throttle_bps = bytes_per_s

    def sent(self) -> int:
        return self.server.bytes_sent


class TestWebHDFSContract(NetworkContract):
    @pytest.fixture
    def target(self, webhdfs: WebHDFSServer, tmp_path: Path) -> _WebHDFSTarget:
        return _WebHDFSTarget(webhdfs, tmp_path)
