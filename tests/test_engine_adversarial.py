"""Adversarial tests of the core byte path: engine deadlocks, cancel, resume order, odd streams.

Each test here was written against a bug found by review (it failed before the fix beside it in
the same commit). Runs that could hang are run in a daemon thread with a deadline, so a
regression fails fast with a clear message instead of stalling the suite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import pytest

from modelcache.engine.transfer import FileJob, TransferEngine, TransferOptions
from modelcache.errors import IntegrityError, ModelcacheError, StoreError
from modelcache.pull import pull, pull_many
from modelcache.sources.base import Checksum
from modelcache.sources.credentials import Settings
from modelcache.sources.local import LocalSource
from modelcache.sources.uri import parse_uri, storage_key
from modelcache.store import NodeStore
from modelcache.store.journal import Journal, seal
from tests.faultproxy import Fault, FaultProxy
from tests.fixtures.http import NginxServer, random_bytes
from tests.helpers import fill_up
from tests.pull_helpers import MiB, assert_store_correct, model_dir, sha256

T = TypeVar("T")
QUICK = dict(max_attempts=3, backoff_initial=0.01, backoff_max=0.05)


def settings() -> Settings:
    return Settings.from_env({})


def within(seconds: float, fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` in a daemon thread; fail (not hang) if it does not return in time."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=run, name="adversarial", daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{what}: still running after {seconds}s (deadlock or missed cancel)"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


# ---- deadlocks ---------------------------------------------------------------------------------


def test_models_failing_integrity_do_not_leak_buffers_and_hang_the_next(nginx: NginxServer, tmp_path: Path) -> None:
    """A file whose last chunk fails its checksum must give its buffer back to the pool.

    With one buffer (one worker, no spares) the second model waited forever in acquire().
    """
    uris = []
    for name in ("a", "b", "c"):
        data = (nginx.write(f"m/{name}.bin", 2 * MiB + 5, seed=ord(name))).read_bytes()
        uris.append(nginx.url(f"m/{name}.bin") + "#sha256=" + sha256(data[::-1]))  # a wrong pin
    good = nginx.write("m/good.bin", 3 * MiB, seed=7).read_bytes()
    uris.append(nginx.url("m/good.bin"))
    opts = TransferOptions(workers=1, chunk_size=MiB, spare_buffers=0, integrity_retries=0, **QUICK)
    root = tmp_path / "root"
    out = within(30, lambda: pull_many(uris, root=root, settings=settings(), options=opts), "pull_many")
    assert [type(r) for r in out[:3]] == [IntegrityError] * 3, out
    assert not isinstance(out[3], BaseException), out[3]
    assert_store_correct(root, {uris[3]: {"good.bin": good}}, must_have={uris[3]})


def test_empty_file_with_a_wrong_checksum_fails_instead_of_hanging(tmp_path: Path) -> None:
    """Zero bytes have no chunk to re-fetch: a mismatch is final, not queued for ever."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "empty.bin").write_bytes(b"")
    source = LocalSource(parse_uri(str(src)), settings())
    (remote,) = source.list_files()
    remote = replace(remote, checksums=(Checksum("sha256", "00" * 32),))
    journal = Journal(str(tmp_path / "journal"))
    journal.open(fresh=True)
    job = FileJob(source, remote, str(tmp_path / "out" / "empty.bin"), journal, 0, "g")
    engine = TransferEngine(TransferOptions(workers=2, chunk_size=MiB, **QUICK))
    results, errors = within(10, lambda: engine.run([job]), "engine.run")
    journal.close()
    assert not results and isinstance(errors.get("g"), IntegrityError), errors


# ---- cancel ------------------------------------------------------------------------------------


def test_cancel_aborts_a_stalled_read_at_once(fault_proxy: FaultProxy, nginx: NginxServer, tmp_path: Path) -> None:
    """Cancel (agent: entry removed, SIGTERM) must not wait for a stalled stream's stall timeout."""
    nginx.write("m/w.bin", 4 * MiB, seed=1)
    fault = fault_proxy.add(Fault("stall", path="/m/w.bin", nth=3, times=None, at=100_000, stall_seconds=25))
    cancel = threading.Event()
    opts = TransferOptions(workers=2, chunk_size=MiB, stall_timeout=60, **QUICK)
    root = tmp_path / "root"
    uri = fault_proxy.url("m/w.bin")

    def go() -> BaseException | None:
        try:
            pull(uri, root=root, settings=settings(), options=opts, cancel=cancel)
        except ModelcacheError as exc:
            return exc
        return None

    def cancel_when_stalled() -> None:
        deadline = time.monotonic() + 10
        while fault.applied < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        cancel.set()

    threading.Thread(target=cancel_when_stalled, daemon=True).start()
    t0 = time.monotonic()
    err = within(20, go, "cancelled pull")
    assert time.monotonic() - t0 < 8, "cancel waited for the stalled streams"
    assert err is not None and "cancelled" in str(err) and "w.bin" in str(err), err
    assert "\n" not in str(err)
    assert not model_dir(root, uri).exists()


# ---- stalls: "no bytes for N s", and the retry asks only for what is missing --------------------


def test_a_slow_link_is_not_a_stall(fault_proxy: FaultProxy, nginx: NginxServer, tmp_path: Path) -> None:
    """Bytes flowing slower than one read's size per stall timeout are still progress.

    The HTTP stream filled the engine's whole 1 MiB read before returning, so at 512 KiB/s a 1.5 s
    stall timeout fired on every attempt although data never stopped, and the pull failed.
    """
    data = nginx.write("m/slow.bin", 3 * MiB // 2, seed=5).read_bytes()
    fault_proxy.set_rate_limit(512 * 1024)
    uri = fault_proxy.url("m/slow.bin")
    opts = TransferOptions(workers=1, chunk_size=2 * MiB, stall_timeout=1.5, **QUICK)
    within(30, lambda: pull(uri, root=tmp_path / "root", settings=settings(), options=opts), "slow pull")
    assert_store_correct(tmp_path / "root", {uri: {"slow.bin": data}}, must_have={uri})


def test_stall_mid_read_is_aborted_and_only_missing_bytes_are_fetched_again(
    fault_proxy: FaultProxy, nginx: NginxServer, tmp_path: Path
) -> None:
    """The watchdog shuts the socket of a stalled read down; what had arrived is kept."""
    data = nginx.write("m/w.bin", 2 * MiB, seed=6).read_bytes()
    fault = fault_proxy.add(Fault("stall", path="/m/w.bin", nth=2, at=900_000, stall_seconds=30))
    uri = fault_proxy.url("m/w.bin")
    opts = TransferOptions(workers=1, chunk_size=2 * MiB, stall_timeout=1.0, **QUICK)
    t0 = time.monotonic()
    within(20, lambda: pull(uri, root=tmp_path / "root", settings=settings(), options=opts), "stalled pull")
    assert time.monotonic() - t0 < 10  # not the 30 s of the stall
    assert fault.applied == 1
    assert_store_correct(tmp_path / "root", {uri: {"w.bin": data}}, must_have={uri})
    # Sent: the 1-byte probe, 900_000 bytes before the stall, then the retry. Bytes that had
    # reached the client before the stall must not be asked for again (a partly filled read
    # may lose a little: well under what was delivered).
    refetched = fault_proxy.bytes_sent["/m/w.bin"] - 1 - len(data)
    assert refetched < 300_000, f"{refetched} bytes fetched twice"


# ---- unknown size: chunked transfer coding, no Content-Length, no Range --------------------------


class _ChunkedHandler(BaseHTTPRequestHandler):
    """Answers every GET with the whole body in chunked coding (nginx cannot be made to)."""

    protocol_version = "HTTP/1.1"
    body = b""
    cut_first: list[int] = []  # cut the first GET bodies after this many bytes (no last chunk)
    gets = 0

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def do_GET(self) -> None:
        cls = type(self)
        cls.gets += 1
        cut = cls.cut_first.pop(0) if cls.cut_first and self.headers.get("Range") is None else None
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        body = self.body if cut is None else self.body[:cut]
        for i in range(0, len(body), 100_000):
            piece = body[i : i + 100_000]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        if cut is not None:
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def chunked_server() -> Iterator[tuple[str, type[_ChunkedHandler]]]:
    handler = type("Handler", (_ChunkedHandler,), {"body": random_bytes(MiB + 12345, seed=11), "cut_first": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/m/stream.bin", handler
    finally:
        server.shutdown()
        server.server_close()


def test_unknown_size_chunked_stream_is_fetched_whole(chunked_server, tmp_path: Path) -> None:
    uri, handler = chunked_server
    opts = TransferOptions(workers=3, chunk_size=256 * 1024, **QUICK)
    res = within(20, lambda: pull(uri, root=tmp_path / "root", settings=settings(), options=opts), "chunked pull")
    assert res.bytes == len(handler.body) and res.files == 1
    assert_store_correct(tmp_path / "root", {uri: {"stream.bin": handler.body}}, must_have={uri})
    assert NodeStore.at(tmp_path / "root").verify(storage_key(uri)) == []


def test_unknown_size_stream_cut_short_is_fetched_again_not_published_short(chunked_server, tmp_path: Path) -> None:
    uri, handler = chunked_server
    handler.cut_first.extend([300_000, 5])  # the first two whole-body GETs end without the last chunk
    opts = TransferOptions(workers=2, chunk_size=256 * 1024, **QUICK)
    within(20, lambda: pull(uri, root=tmp_path / "root", settings=settings(), options=opts), "chunked pull")
    assert not handler.cut_first, "the faults did not fire"
    assert_store_correct(tmp_path / "root", {uri: {"stream.bin": handler.body}}, must_have={uri})


# ---- memory ------------------------------------------------------------------------------------

_RSS_SCRIPT = """
import json, sys
from modelcache.sources.credentials import Settings
from modelcache.pull import pull
from modelcache.engine.transfer import TransferOptions
opts = TransferOptions(workers=8, chunk_size=int(sys.argv[3]))
res = pull(sys.argv[1], root=sys.argv[2], settings=Settings.from_env({}), options=opts)
# VmHWM, not ru_maxrss: the latter is inherited from the parent across fork and exec.
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0].split()[1]
print(json.dumps({"peak_kib": int(hwm), "bytes": res.bytes}))
"""


def test_peak_rss_of_one_large_file_with_8_workers_stays_within_the_buffer_pool(
    nginx: NginxServer, tmp_path: Path
) -> None:
    """(workers + spares) x chunk plus the interpreter: out-of-order chunks must not pile up."""
    import json
    import subprocess
    import sys

    from tests.helpers import REPO

    chunk = 4 * MiB
    size = 96 * MiB + 4097
    nginx.write("m/big.bin", size, seed=12)
    uri = nginx.url("m/big.bin")
    r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, uri, str(tmp_path / "root"), str(chunk)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bytes"] == size
    pool = (8 + 4) * chunk
    assert out["peak_kib"] * 1024 <= pool + 80 * MiB, f"peak RSS {out['peak_kib'] / 1024:.0f} MiB"


# ---- a disk that fills up during the download ---------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 96 MiB tmpfs (root only); elsewhere skipped locally, failed in CI."""
    from tests.helpers import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "fs", "size=96m") as mnt:
        yield mnt


@pytest.mark.parametrize("mib", [24, 8], ids=["journal-full", "publish-full"])
def test_disk_filled_by_someone_else_mid_download_is_a_clear_space_error_then_resumes(
    fault_proxy: FaultProxy, nginx: NginxServer, tiny_fs: Path, mib: int
) -> None:
    """Data files are preallocated, so when the disk fills up later the journal is what fails to grow
    (or, with few journal lines, the manifest at publish).

    The journal raised a bare OSError ("[Errno 28] ...", no path, no fix) instead of the store's
    space error, and the publish error did not name the URI.
    """
    data = nginx.write("m/w.bin", mib * MiB, seed=13).read_bytes()
    uri = fault_proxy.url("m/w.bin")
    root = tiny_fs / "root"
    # 64 KiB chunks: 384 journal lines of ~15 bytes for 24 MiB outgrow the journal's first 4 KiB page.
    opts = TransferOptions(workers=2, chunk_size=64 * 1024, **QUICK)
    # The first chunk requests hold their bodies for 2 s: the download has begun (files
    # preallocated) when the disk fills up.
    fault_proxy.add(Fault("stall", path="/m/w.bin", nth=2, times=2, at=0, stall_seconds=2))
    box: dict[str, BaseException | None] = {}

    def go() -> None:
        try:
            pull(uri, root=root, settings=settings(), options=opts)
            box["err"] = None
        except BaseException as exc:
            box["err"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    staged = root / ".modelcache" / "staging" / storage_key(uri) / "data" / "w.bin"
    deadline = time.monotonic() + 10
    while not (staged.exists() and staged.stat().st_blocks * 512 >= len(data)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert staged.exists(), "the download did not start"
    filler = fill_up(tiny_fs / "filler")
    t.join(30)
    assert not t.is_alive(), "the pull hung on a full disk"
    err = box["err"]
    assert isinstance(err, StoreError), repr(err)
    assert "space" in str(err).lower() and uri in str(err) and "\n" not in str(err), err
    assert not model_dir(root, uri).exists()
    filler.unlink()  # space again: the next pull completes
    within(30, lambda: pull(uri, root=root, settings=settings(), options=opts), "pull after freeing space")
    assert_store_correct(root, {uri: {"w.bin": data}}, must_have={uri})


# ---- the resume journal after a reboot ----------------------------------------------------------


def test_sync_mark_never_covers_a_line_written_while_the_files_synced(
    fault_proxy: FaultProxy, nginx: NginxServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a reboot only lines before a sync mark are trusted, so a mark may only cover lines
    whose data was fdatasync'ed. The sync thread synced the files, *then* appended ``S``: a piece
    journaled by a worker in between was trusted after a power loss although its data may never
    have reached the disk (read back as zeros and, without a source checksum, published).

    Instrumented (the real calls go through): right after the engine's first fdatasync, a line
    is journaled as a worker would; the journal as it stands after the next mark is then read
    as after a reboot.
    """
    from modelcache.store import diskio, journal

    nginx.write("m/w.bin", 4 * MiB, seed=14)
    fault_proxy.set_rate_limit(8 * MiB)  # ~0.5 s: several sync rounds
    uri = fault_proxy.url("m/w.bin")
    journals: list[Journal] = []
    state: dict[str, object] = {}
    real_open, real_datasync, real_synced = journal.Journal.open, diskio.FileWriter.datasync, journal.Journal.synced

    def open_(self: Journal, fresh: bool) -> None:
        journals.append(self)
        real_open(self, fresh)

    def datasync(self: diskio.FileWriter) -> None:
        real_datasync(self)
        if "injected" not in state:
            state["injected"] = True
            journals[0].chunk(0, 999, 4096)  # a worker's piece, journaled just after the sync

    def synced(self: Journal, *args: object, **kwargs: object) -> None:
        real_synced(self, *args, **kwargs)
        if "injected" in state and "text" not in state:
            state["text"] = Path(self.path).read_text()

    monkeypatch.setattr(journal.Journal, "open", open_)
    monkeypatch.setattr(diskio.FileWriter, "datasync", datasync)
    monkeypatch.setattr(journal.Journal, "synced", synced)
    opts = TransferOptions(workers=2, chunk_size=256 * 1024, sync_interval=0.05, **QUICK)
    pull(uri, root=tmp_path / "root", settings=settings(), options=opts)
    text = state.get("text")
    assert isinstance(text, str), "no sync round ran during the pull"
    lines = [journal.unseal(ln) or "" for ln in text.splitlines()]
    injected = lines.index("c 0 999 4096")
    assert any(ln.startswith("S") for ln in lines[injected:]), "no mark after the injected line"
    rebooted = tmp_path / "journal-after-reboot"
    rebooted.write_text(journal.seal("\n".join("boot another-boot" if ln.startswith("boot ") else ln
                                               for ln in lines) + "\n"))
    trusted = Journal(str(rebooted)).load()
    assert (0, 999) not in trusted.chunks, "a line journaled after the fdatasync was covered by the mark"


def test_journal_marks_cover_counted_lines_and_a_torn_tail_cannot_swallow_the_next_boot(tmp_path: Path) -> None:
    p = tmp_path / "journal"
    # An earlier boot: its mark covers one line; then a line after the mark, then one torn by the crash.
    p.write_text(seal("boot earlier-boot\nc 0 0 4096\nc 0 1 4096\nS 1\nc 0 2 4096\n") + "c 0 3 40")
    j = Journal(str(p))
    assert j.load().chunks == {(0, 0): 4096}
    j.open(fresh=False)  # this boot: every line of its own segment is trusted
    j.chunk(1, 0, 8192)
    assert j.mark() == 1
    j.synced(j.mark())
    j.close()
    assert j.load().chunks == {(0, 0): 4096, (1, 0): 8192}


# ---- a file replaced on the server between two runs ----------------------------------------------


class _RangeHandler(BaseHTTPRequestHandler):
    """Ranges and Last-Modified but no ETag (as python's http.server and many app servers)."""

    protocol_version = "HTTP/1.1"
    body = b""
    mtime = 0.0
    fail_from = 0  # answer 503 to the nth and later GETs of a chunk (0: never)
    gets = 0

    def log_message(self, *args: object) -> None:
        pass

    def _head(self, code: int, length: int, extra: dict[str, str]) -> None:
        from email.utils import formatdate

        self.send_response(code)
        self.send_header("Content-Length", str(length))
        if self.mtime:
            self.send_header("Last-Modified", formatdate(self.mtime, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()

    def do_HEAD(self) -> None:
        self._head(200, len(self.body), {})

    def do_GET(self) -> None:
        import re
        from email.utils import parsedate_to_datetime

        cls = type(self)
        rng = self.headers.get("Range")
        if rng and rng != "bytes=0-0":
            cls.gets += 1
            if cls.fail_from and cls.gets >= cls.fail_from:
                self._head(503, 0, {})
                return
        since = self.headers.get("If-Unmodified-Since")
        if since and self.mtime and parsedate_to_datetime(since).timestamp() < int(self.mtime):
            self._head(412, 0, {})
            return
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        if not m:
            self._head(200, len(self.body), {})
            self.wfile.write(self.body)
            return
        start = int(m.group(1))
        end = int(m.group(2)) if m.group(2) else len(self.body) - 1
        end = min(end, len(self.body) - 1)
        self._head(206, end - start + 1, {"Content-Range": f"bytes {start}-{end}/{len(self.body)}"})
        self.wfile.write(self.body[start : end + 1])


@pytest.mark.parametrize("validator", ["last-modified", "none"])
def test_file_replaced_with_same_size_between_runs_is_not_mixed_into_the_resume(tmp_path: Path, validator: str) -> None:
    """Without an ETag the listing's version was None, so a staged download of the old file
    matched the new listing (same size) and its chunks were resumed into the new one: a
    silently mixed file (re-uploaded weights of the same shape are the usual case). With
    Last-Modified that is the version; with no validator at all the file is fetched whole again."""
    old, new = random_bytes(4 * MiB, seed=21), random_bytes(4 * MiB, seed=22)
    mtime = 1_700_000_000.0 if validator == "last-modified" else 0.0
    handler = type("Handler", (_RangeHandler,), {"body": old, "mtime": mtime, "fail_from": 3, "gets": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}/m/w.bin"
        root = tmp_path / "root"
        opts = TransferOptions(workers=1, chunk_size=MiB, max_attempts=2, backoff_initial=0.01, backoff_max=0.02)
        # Run 1: two chunks of the old file land, then the server fails: staged, resumable.
        with pytest.raises(ModelcacheError):
            pull(uri, root=root, settings=settings(), options=opts)
        assert not model_dir(root, uri).exists()
        # The file is replaced (same size, newer), the server heals, run 2.
        handler.body, handler.mtime, handler.fail_from = new, mtime and mtime + 600, 0
        within(20, lambda: pull(uri, root=root, settings=settings(), options=opts), "second pull")
        assert_store_correct(root, {uri: {"w.bin": new}}, must_have={uri})
    finally:
        server.shutdown()
        server.server_close()


# ---- processes pulling overlapping sets of models at once ----------------------------------------


def test_processes_pulling_overlapping_uri_sets_neither_deadlock_nor_download_twice(
    nginx: NginxServer, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Locks are taken in one global order, so {A, B}, {C, B} and {B, A} at once all finish."""
    from tests.helpers import wait_until
    from tests.pull_helpers import popen_cli

    files = {name: nginx.write(f"m/{name}.bin", MiB + 333, seed=30 + i).read_bytes()
             for i, name in enumerate("abc")}
    uri = {name: fault_proxy.url(f"m/{name}.bin") for name in files}
    root = tmp_path / "root"
    common = ("--root", str(root), "--chunk-size", "256K", "--progress", "none", "--json")
    fault_proxy.pause()  # the first process takes its locks and is held mid-listing
    first = popen_cli("pull", uri["a"], uri["b"], *common)
    wait_until(lambda: sum(fault_proxy.requests.values()) >= 2 or first.poll() is not None, what="first pull")
    others = [popen_cli("pull", uri["c"], uri["b"], *common), popen_cli("pull", uri["b"], uri["a"], *common)]
    time.sleep(1.0)
    assert all(p.poll() is None for p in [first, *others]), "a pull did not wait for the models' locks"
    fault_proxy.resume()
    for p in [first, *others]:
        _out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    assert_store_correct(root, {uri[n]: {f"{n}.bin": files[n]} for n in files}, must_have=set(uri.values()))
    for n, data in files.items():
        body = [e for e in nginx.requests_for(f"m/{n}.bin") if e.range != "bytes=0-0"]
        assert sum(e.bytes_sent for e in body) == len(data), f"{n}.bin downloaded more than once: {body}"


# ---- a run of several chunks per request, broken in the middle -------------------------------------


def _range_len(rng: str | None) -> int:
    import re

    m = re.fullmatch(r'"?bytes=(\d+)-(\d+)"?', rng or "")
    return int(m.group(2)) - int(m.group(1)) + 1 if m else 0


@pytest.mark.parametrize("persistent", [False, True], ids=["retried", "failed-then-resumed"])
def test_run_of_chunks_broken_midway_fetches_only_what_is_missing(
    nginx: NginxServer, fault_proxy: FaultProxy, tmp_path: Path, persistent: bool
) -> None:
    chunk = 256 * 1024
    data = nginx.write("m/w.bin", 16 * chunk, seed=40).read_bytes()
    uri = fault_proxy.url("m/w.bin")
    root = tmp_path / "root"
    # Slow first bytes on three requests: the engine merges chunks into runs of 2, 4, then 8.
    fault_proxy.add(Fault("stall", path="/m/w.bin", nth=2, times=3, at=0, stall_seconds=0.3))
    # A body cut (FIN, not RST: a reset makes the kernel drop what the client had not read yet,
    # which would blur what was fetched twice) in chunk 11 of the 8-chunk run 7-14.
    cut = fault_proxy.add(Fault("truncate", path="/m/w.bin", file_offset=11 * chunk + 1000, nth=5,
                                times=None if persistent else 1))
    opts = TransferOptions(workers=1, chunk_size=chunk, max_attempts=3, backoff_initial=0.01, backoff_max=0.02,
                           stall_timeout=10)
    if persistent:
        with pytest.raises(ModelcacheError):
            pull(uri, root=root, settings=settings(), options=opts)
        assert not model_dir(root, uri).exists()
        fault_proxy.clear()
        before = fault_proxy.bytes_sent["/m/w.bin"]
        within(20, lambda: pull(uri, root=root, settings=settings(), options=opts), "resumed pull")
        resumed = fault_proxy.bytes_sent["/m/w.bin"] - before
        # Chunks 0-10 were journaled whole; chunk 11 had not completed: the resume fetches 11-15.
        assert resumed - 1 <= 5 * chunk, f"the resume fetched {resumed} bytes"
    else:
        within(20, lambda: pull(uri, root=root, settings=settings(), options=opts), "pull")
        refetched = fault_proxy.bytes_sent["/m/w.bin"] - 1 - len(data)
        assert refetched == 0, f"{refetched} bytes fetched twice"
    assert cut.applied >= 1
    spans = [_range_len(e.range) for e in nginx.requests_for("m/w.bin")]
    assert max(spans) > 2 * chunk, f"no request spanned a run of chunks: {spans}"
    assert_store_correct(root, {uri: {"w.bin": data}}, must_have={uri})


# ---- store: removal never shows anything else under models/ ----------------------------------------


def test_rm_never_shows_a_trash_folder_under_models_and_ls_ignores_leftovers(tmp_path: Path) -> None:
    """``rm`` renamed the model to ``models/.trash-*`` before deleting it: serving pods and ``ls``
    saw an extra entry, and one left by a crash stayed listed as a model for ever."""
    from tests.pull_helpers import StoreWatcher

    src = tmp_path / "src"
    for i in range(1500):
        p = src / f"d{i % 30}" / f"f{i}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * (i % 7))
    root = tmp_path / "root"
    uri = str(src)
    pull(uri, root=root, settings=settings(), options=TransferOptions(workers=4, chunk_size=MiB))
    store = NodeStore.at(root)
    expected = {uri: {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}}
    with StoreWatcher(root, expected, interval=0.001) as watcher:
        assert store.remove(storage_key(uri))
    assert watcher.problems == [], watcher.problems[:3]
    # A crash between the rename and the delete left a trash folder: not a model.
    (root / "models" / ".trash-0123456789abcdef-1").mkdir()
    (root / ".modelcache" / "staging" / ".trash-0123456789abcdef-2").mkdir(parents=True)
    assert [e.storage_key for e in store.entries()] == []
    store.gc(target_free=0)
    assert not (root / ".modelcache" / "staging" / ".trash-0123456789abcdef-2").exists()
    assert not (root / "models" / ".trash-0123456789abcdef-1").exists()


def test_range_answered_with_the_whole_file_once_is_retried_without_reading_that_body(tmp_path: Path) -> None:
    """Some caches answer a ranged GET with 200 and the whole object (on a miss). The engine read
    that whole body to reuse the connection, then failed the pull as an unexpected status."""
    body = random_bytes(24 * MiB, seed=50)
    state = {"whole_left": 1, "whole_completed": 0}

    class Handler(_RangeHandler):
        def do_GET(self) -> None:
            rng = self.headers.get("Range")
            if rng and rng != "bytes=0-0" and state["whole_left"]:
                state["whole_left"] -= 1
                self._head(200, len(self.body), {})
                try:
                    for i in range(0, len(self.body), MiB):
                        self.wfile.write(self.body[i : i + MiB])
                        time.sleep(0.01)  # a body that takes a while: the client must not wait it out
                    state["whole_completed"] += 1
                except OSError:
                    pass
                return
            super().do_GET()

    Handler.body, Handler.mtime = body, 1_700_000_000.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}/m/w.bin"
        opts = TransferOptions(workers=2, chunk_size=4 * MiB, **QUICK)
        within(30, lambda: pull(uri, root=tmp_path / "root", settings=settings(), options=opts), "pull")
        assert state["whole_left"] == 0
        assert state["whole_completed"] == 0, "the client read a whole-file answer to a ranged request"
        assert_store_correct(tmp_path / "root", {uri: {"w.bin": body}}, must_have={uri})
    finally:
        server.shutdown()
        server.server_close()


# ---- redirects -----------------------------------------------------------------------------------


def test_redirects_are_followed_per_request_and_host_headers_stay_with_their_host(tmp_path: Path) -> None:
    """HTTP model URLs often redirect (release downloads, hubs, presigned storage URLs); KServe's
    requests-based download follows them. The pool was built with retries=False, which also turned
    redirects off: every such pull failed with "unexpected HTTP 302"."""
    body = random_bytes(3 * MiB + 17, seed=60)
    seen: list[tuple[str, str | None, str | None]] = []  # (path, Range, the host header we configured)

    class Handler(_RangeHandler):
        def do_HEAD(self) -> None:
            if not self._redirect():
                super().do_HEAD()

        def do_GET(self) -> None:
            if not self._redirect():
                seen.append((self.path, self.headers.get("Range"), self.headers.get("X-Token")))
                super().do_GET()

        def _redirect(self) -> bool:
            port = self.server.server_address[1]
            target = {"/a/w.bin": "/b/w.bin",  # same host, relative
                      "/b/w.bin": f"http://localhost:{port}/m/w.bin"}.get(self.path)  # another host name
            if target is None:
                return False
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True

    Handler.body, Handler.mtime = body, 1_700_000_000.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}/a/w.bin"
        env = Settings.from_env({"127.0.0.1-headers": '{"X-Token": "for-127.0.0.1-only"}'})
        opts = TransferOptions(workers=2, chunk_size=MiB, **QUICK)
        within(30, lambda: pull(uri, root=tmp_path / "root", settings=env, options=opts), "redirected pull")
        assert_store_correct(tmp_path / "root", {uri: {"w.bin": body}}, must_have={uri})
        ranged = [r for p, r, _ in seen if p == "/m/w.bin" and r and r != "bytes=0-0"]
        assert len(ranged) >= 3, f"chunks were not fetched with ranges through the redirect: {seen}"
        assert all(tok is None for _, _, tok in seen), "a header configured for one host was sent to another"
    finally:
        server.shutdown()
        server.server_close()


def test_presigned_style_url_that_refuses_head_is_listed_with_the_ranged_probe(tmp_path: Path) -> None:
    """S3 and GCS presigned URLs are signed for GET: a HEAD answers 403. KServe only GETs, so
    such URIs worked there; here the listing's HEAD failed the pull as "403 Forbidden"."""
    import base64
    import hashlib

    body = random_bytes(2 * MiB + 5, seed=70)
    digest = base64.b64encode(hashlib.sha256(body).digest()).decode()

    class Handler(_RangeHandler):
        def do_HEAD(self) -> None:
            self._head(403, 0, {})

        def _head(self, code: int, length: int, extra: dict[str, str]) -> None:
            if self.command == "GET":
                extra = {**extra, "Repr-Digest": f"sha-256=:{digest}:"}
            super()._head(code, length, extra)

    Handler.body, Handler.mtime = body, 1_700_000_000.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}/bucket/w.bin?X-Amz-Signature=abc"
        opts = TransferOptions(workers=2, chunk_size=MiB, **QUICK)
        res = within(30, lambda: pull(uri, root=tmp_path / "root", settings=settings(), options=opts), "pull")
        assert res.bytes == len(body) and res.verified == ("sha256",)
        assert_store_correct(tmp_path / "root", {uri: {"w.bin": body}}, must_have={uri})
    finally:
        server.shutdown()
        server.server_close()


# ---- resume inside a chunk ---------------------------------------------------------------------


def test_resume_inside_a_partly_journaled_chunk_hashes_in_order_and_fetches_only_the_rest(
    nginx: NginxServer, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Chunks larger than a journal piece (4 MiB) are journaled piece by piece; a resume reads the
    journaled part back into the chunk's buffer, fetches the rest, and hashes the file in order."""
    chunk = 12 * MiB
    data = nginx.write("m/w.bin", 2 * chunk + 123, seed=80).read_bytes()
    uri = fault_proxy.url("m/w.bin") + "#sha256=" + sha256(data)
    root = tmp_path / "root"
    opts = TransferOptions(workers=1, chunk_size=chunk, max_attempts=2, backoff_initial=0.01, backoff_max=0.02)
    fault_proxy.add(Fault("truncate", path="/m/w.bin", file_offset=9 * MiB + 777, times=None))
    with pytest.raises(ModelcacheError):
        pull(uri, root=root, settings=settings(), options=opts)
    from tests.pull_helpers import journaled_bytes

    assert journaled_bytes(root, uri) == 8 * MiB  # two pieces of chunk 0
    fault_proxy.clear()
    before = fault_proxy.bytes_sent["/m/w.bin"]
    res = within(30, lambda: pull(uri, root=root, settings=settings(), options=opts), "resumed pull")
    assert fault_proxy.bytes_sent["/m/w.bin"] - before == len(data) - 8 * MiB + 1  # + the probe's byte
    assert res.verified == ("sha256",)
    assert_store_correct(root, {uri: {"w.bin": data}}, must_have={uri})
    assert NodeStore.at(root).verify(storage_key(uri)) == []


# ---- Ctrl-C --------------------------------------------------------------------------------------


def test_ctrl_c_stops_the_workers_before_their_files_are_closed(
    nginx: NginxServer, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """KeyboardInterrupt in the calling thread closed every file while the workers went on: they
    kept fetching, opened new files (which can reuse a closed descriptor number) and wrote into
    them. The engine now cancels and joins its workers first."""
    import signal

    files = {f"f{i}.bin": nginx.write(f"m/d/f{i}.bin", MiB, seed=90 + i).read_bytes() for i in range(6)}
    fault_proxy.set_rate_limit(2 * MiB)
    uris = [fault_proxy.url(f"m/d/{name}") for name in files]
    opts = TransferOptions(workers=3, chunk_size=256 * 1024, stall_timeout=30, **QUICK)
    main = threading.get_ident()

    def interrupt() -> None:
        deadline = time.monotonic() + 10
        while fault_proxy.total_bytes_sent < MiB and time.monotonic() < deadline:
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        pull_many(uris, root=tmp_path / "root", settings=settings(), options=opts)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("modelcache-worker")]
    time.sleep(0.3)  # the proxy may still count a piece per connection it had handed to the kernel
    sent = fault_proxy.total_bytes_sent
    time.sleep(0.5)
    assert alive == [], f"workers still running after the interrupt: {alive}"
    assert fault_proxy.total_bytes_sent == sent, "bytes still flowing after the interrupt"


# ---- publish into a destination folder, interrupted ----------------------------------------------


def test_dest_publish_interrupted_before_the_manifest_is_recovered_not_downloaded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The initializer's layout merges the staged files into the destination, then installs the
    manifest. The emptied staging ``data`` folder stayed, so after a crash between the two steps
    ``recover`` did not see a finished publish and the whole model was fetched again."""
    from modelcache.store import Store  # the kind both stores share: a dest pull publishes through DestStore

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "w.bin").write_bytes(random_bytes(2 * MiB, seed=95))
    (src / "sub" / "c.json").write_bytes(b"{}")
    dest = tmp_path / "dest"
    opts = TransferOptions(workers=2, chunk_size=MiB, **QUICK)
    real = Store._install_manifest

    def crash(self: Store, key: str, pending: Path) -> None:
        raise KeyboardInterrupt  # the process dies here (nothing else runs)

    monkeypatch.setattr(Store, "_install_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        pull(str(src), dest=dest, settings=settings(), options=opts)
    monkeypatch.setattr(Store, "_install_manifest", real)
    res = pull(str(src), dest=dest, settings=settings(), options=opts)
    assert res.cached, "the model was downloaded again"
    assert (dest / "w.bin").read_bytes() == (src / "w.bin").read_bytes()
    assert (dest / "sub" / "c.json").read_bytes() == b"{}"


# ---- one pull_many, the same relative paths in several models, a URI twice -------------------------


def test_same_paths_in_several_models_and_a_repeated_uri_in_one_pull_many(tmp_path: Path) -> None:
    srcs, expected = [], {}
    for i in range(3):
        src = tmp_path / f"src{i}"
        (src / "sub").mkdir(parents=True)
        files = {"config.json": b"{}" * i, "w.bin": random_bytes(MiB + i * 4096, seed=100 + i),
                 "sub/empty": b"", "sub/chunk.bin": random_bytes(256 * 1024, seed=200 + i)}
        for rel, data in files.items():
            (src / rel).write_bytes(data)
        srcs.append(str(src))
        expected[str(src)] = files
    uris = [srcs[0], srcs[1], srcs[0], srcs[2]]
    opts = TransferOptions(workers=4, chunk_size=256 * 1024, **QUICK)
    out = within(30, lambda: pull_many(uris, root=tmp_path / "root", settings=settings(), options=opts), "pull_many")
    assert all(not isinstance(r, BaseException) for r in out), out
    assert out[0] == out[2]
    assert_store_correct(tmp_path / "root", expected, must_have=set(srcs))
    store = NodeStore.at(tmp_path / "root")
    assert all(store.verify(storage_key(u)) == [] for u in srcs)


def test_a_source_that_picks_its_chunks_is_read_in_its_order_and_hashed_in_file_order(tmp_path: Path) -> None:
    """Source.pick_chunk (peer transfer reads its own pieces first): the engine asks which pending
    chunk comes next; chunks then land out of order and the file is still hashed in order."""
    src = tmp_path / "src"
    src.mkdir()
    body = random_bytes(8 * MiB + 5, 3)
    (src / "w.bin").write_bytes(body)
    opened: list[int] = []

    class Backwards(LocalSource):
        def pick_chunk(self, file, starts):  # type: ignore[no-untyped-def]
            return len(starts) - 1

        def open_range(self, file, start, end):  # type: ignore[no-untyped-def]
            opened.append(start)
            return super().open_range(file, start, end)

    source = Backwards(parse_uri(str(src)), settings())
    (remote,) = source.list_files()
    remote = replace(remote, checksums=(Checksum("sha256", sha256(body)),))
    journal = Journal(str(tmp_path / "journal"))
    journal.open(fresh=True)
    job = FileJob(source, remote, str(tmp_path / "out" / "w.bin"), journal, 0, "g")
    engine = TransferEngine(TransferOptions(workers=1, chunk_size=MiB, **QUICK))
    results, errors = within(20, lambda: engine.run([job]), "engine.run")
    journal.close()
    assert not errors and results["g"][0].verified == ("sha256",)
    assert opened == sorted(opened, reverse=True) and len(opened) == 9  # one chunk per request, last first
    assert (tmp_path / "out" / "w.bin").read_bytes() == body
