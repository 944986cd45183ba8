"""Sources whose bytes change under a download: every response is checked against the listing.

Each test failed before the fix beside it (issue 20, points 2, 3, 4, 9 and 10). The servers are
nginx (tests/fixtures/http.py) with the fault proxy in front of it (tests/faultproxy.py) to make
it behave as servers and caches seen in the wild do: one that drops ``If-Match`` (so it never
answers 412), one with no validators at all (no ETag, no Last-Modified), one whose body is
delimited by closing the connection. The file is replaced in nginx's docroot between two
requests of the same download, at a point the proxy's request hook chooses.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from modelcache.engine.transfer import TransferOptions
from modelcache.errors import IntegrityError, SourceChangedError, SourceError
from modelcache.pull import pull
from modelcache.sources import local as local_mod
from modelcache.sources.base import RemoteFile, open_source
from modelcache.sources.credentials import Settings
from modelcache.sources.local import LocalSource
from modelcache.sources.ranges import check_total, parse_content_range
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.faultproxy import Fault, FaultProxy
from tests.fixtures.http import NginxServer, random_bytes
from tests.objectstore_data import read_range


def test_range_stream_closed_from_two_threads_closes_its_descriptor_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Point 9: the watchdog (or a cancel) and the worker both close a local range stream. Both
    saw the descriptor still open and closed the same number twice; by the second close the
    kernel may have handed that number to a file being written, which then lost its descriptor."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 100)
    stream = local_mod._FileStream(str(f), 0, None)
    closed: list[int] = []
    errors: list[BaseException] = []

    def close_from_the_watchdog() -> None:
        try:
            stream.close()
        except BaseException as exc:
            errors.append(exc)

    def close(fd: int) -> None:
        closed.append(fd)
        if len(closed) == 1:
            # The worker is inside close(), between its check and its bookkeeping: the watchdog
            # closes now.
            other = threading.Thread(target=close_from_the_watchdog)
            other.start()
            other.join(10)
        os.close(fd)

    fake_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    fake_os.close = close
    monkeypatch.setattr(local_mod, "os", fake_os)
    try:
        stream.close()
    except OSError:
        pass  # the old code's second close of the number hit EBADF here
    assert closed == [closed[0]], f"descriptor closed {len(closed)} times"
    assert not errors


# ---- local files (point 4) -------------------------------------------------------------------

MiB = 1 << 20
LOCAL_OPTS = TransferOptions(workers=1, chunk_size=MiB, max_attempts=2, backoff_initial=0.01, backoff_max=0.02)


def _on_nth_open(monkeypatch: pytest.MonkeyPatch, nth: int, action: Callable[[], None]) -> list[int]:
    """Run ``action`` just before the source opens its ``nth`` range (the copy is under way)."""
    real = LocalSource.open_range
    starts: list[int] = []

    def open_range(self: LocalSource, file: RemoteFile, start: int, end: int | None) -> Any:
        starts.append(start)
        if len(starts) == nth:
            action()
        return real(self, file, start, end)

    monkeypatch.setattr(LocalSource, "open_range", open_range)
    return starts


@pytest.mark.parametrize("how", ["in-place", "in-place-mtime-kept", "replaced-mtime-kept"])
def test_local_file_rewritten_during_its_copy_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Its version (mtime and size) was taken from the listing and never looked at again: a file
    rewritten with the same size while it was copied was published half old, half new."""
    old, new = random_bytes(4 * MiB, seed=1), random_bytes(4 * MiB, seed=2)
    src = tmp_path / "src" / "w.bin"
    src.parent.mkdir()
    src.write_bytes(old)
    before = src.stat()

    def rewrite() -> None:
        if how == "replaced-mtime-kept":  # a new file moved over it (a new inode), times copied
            tmp = src.with_name("w.tmp")
            tmp.write_bytes(new)
            os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
            os.replace(tmp, src)
            return
        with open(src, "r+b") as f:
            f.write(new)
        if how == "in-place-mtime-kept":  # the writer puts the mtime back (cp -p, rsync -t)
            os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))

    starts = _on_nth_open(monkeypatch, 3, rewrite)
    root = tmp_path / "root"
    with pytest.raises(SourceChangedError, match=r"'w.bin' changed during the copy"):
        pull(f"file://{src}", root=root, settings=Settings.from_env({}), options=LOCAL_OPTS)
    assert len(starts) >= 3
    assert not NodeStore.at(root).is_present(storage_key(f"file://{src}"))
    # Pulled again, the new file is listed and copied whole.
    monkeypatch.undo()
    res = pull(f"file://{src}", root=root, settings=Settings.from_env({}), options=LOCAL_OPTS)
    assert (res.path / "w.bin").read_bytes() == new


def test_same_size_copy_with_the_mtime_kept_between_two_runs_is_not_resumed_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cp -p`` of a same-size file between a failed run and its resume: the version (mtime and
    size) matched, so the staged chunks of the old file were resumed into the new one."""
    old, new = random_bytes(4 * MiB, seed=3), random_bytes(4 * MiB, seed=4)
    src = tmp_path / "src" / "w.bin"
    src.parent.mkdir()
    src.write_bytes(old)
    before = src.stat()

    def fail() -> None:
        raise SourceError("the source went away (test)")

    _on_nth_open(monkeypatch, 3, fail)
    root = tmp_path / "root"
    uri = f"file://{src}"
    with pytest.raises(SourceError, match="went away"):
        pull(uri, root=root, settings=Settings.from_env({}), options=LOCAL_OPTS)
    monkeypatch.undo()
    other = tmp_path / "other.bin"
    other.write_bytes(new)
    os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
    subprocess.run(["cp", "-p", str(other), str(src)], check=True)  # same inode, same size and mtime
    res = pull(uri, root=root, settings=Settings.from_env({}), options=LOCAL_OPTS)
    assert (res.path / "w.bin").read_bytes() == new


# ---- HTTP (points 2, 3 and 10) ---------------------------------------------------------------

HTTP_OPTS = TransferOptions(workers=1, chunk_size=MiB, max_attempts=3, backoff_initial=0.01, backoff_max=0.02,
                            integrity_retries=1)
VALIDATORS = {"etag", "last-modified"}
CONDITIONS = {"if-match", "if-unmodified-since", "if-range"}


def _replace_on_nth_get(proxy: FaultProxy, nginx: NginxServer, rel: str, nth: int, new: bytes) -> list[str | None]:
    """Replace the file in nginx's docroot (a new inode, a later mtime: a new nginx ETag) just
    before the proxy forwards the ``nth`` data GET of it (the one-byte listing probe not counted)."""
    seen: list[str | None] = []

    def hook(method: str, path: str, headers: dict[str, str]) -> None:
        if method != "GET" or path != "/" + rel or headers.get("range") == "bytes=0-0":
            return
        seen.append(headers.get("range"))
        if len(seen) == nth:
            target = nginx.docroot / rel
            tmp = target.with_name(target.name + ".new")
            tmp.write_bytes(new)
            os.chmod(tmp, 0o644)
            mtime = target.stat().st_mtime + 60
            os.utime(tmp, (mtime, mtime))
            os.replace(tmp, target)

    proxy.on_request = hook
    return seen


def _pull(uri: str, root: Path) -> Any:
    return pull(uri, root=root, settings=Settings.from_env({}), options=HTTP_OPTS)


@pytest.mark.parametrize(("server", "caught_by"), [
    ("honours-if-match", r"download; pull again"),  # nginx answers 412
    ("ignores-if-match", r"its ETag is now"),
    ("no-validators", r"its size is now 5243003 bytes, listed 4194304"),
])
def test_file_replaced_on_the_server_mid_download_is_never_published_mixed(
    fault_proxy: FaultProxy, nginx: NginxServer, tmp_path: Path, server: str, caught_by: str
) -> None:
    """Point 2: only the start of Content-Range was checked. A server that ignores If-Match
    answered the later ranges from the new file (its ETag differed: not looked at); one without
    validators announced the new size in Content-Range's total (not looked at either)."""
    old, new = random_bytes(4 * MiB, seed=5), random_bytes(5 * MiB + 123, seed=6)
    nginx.write("m/w.bin", old)
    if server == "ignores-if-match":
        fault_proxy.drop_request_headers = set(CONDITIONS)
    elif server == "no-validators":
        fault_proxy.drop_response_headers = set(VALIDATORS)
    seen = _replace_on_nth_get(fault_proxy, nginx, "m/w.bin", 2, new)
    uri = fault_proxy.url("m/w.bin")
    root = tmp_path / "root"
    with pytest.raises(SourceChangedError, match=caught_by):
        _pull(uri, root)
    assert len(seen) >= 2, seen
    assert not NodeStore.at(root).is_present(storage_key(uri))
    fault_proxy.on_request = None
    res = _pull(uri, root)  # listed again: the new file, whole
    assert (res.path / "w.bin").read_bytes() == new


def test_same_size_replacement_without_validators_is_caught_only_by_a_pinned_digest(
    fault_proxy: FaultProxy, nginx: NginxServer, tmp_path: Path
) -> None:
    """With no ETag, no Last-Modified and the same size, no response differs from the listing:
    what the user pins (#sha256=) is the only check left (docs/integrity.md says so)."""
    old, new = random_bytes(4 * MiB, seed=7), random_bytes(4 * MiB, seed=8)
    nginx.write("m/w.bin", old)
    fault_proxy.drop_response_headers = set(VALIDATORS)
    _replace_on_nth_get(fault_proxy, nginx, "m/w.bin", 2, new)
    uri = fault_proxy.url("m/w.bin") + "#sha256=" + hashlib.sha256(old).hexdigest()
    root = tmp_path / "root"
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        _pull(uri, root)
    assert not NodeStore.at(root).is_present(storage_key(uri))


@pytest.mark.parametrize("framing", ["content-length", "close-delimited"])
def test_whole_file_get_of_a_grown_file_is_refused_not_cut_to_the_listed_size(
    fault_proxy: FaultProxy, nginx: NginxServer, tmp_path: Path, framing: str
) -> None:
    """Point 3: a GET covering the whole file took any 200 and read the listed number of bytes:
    the first 512 KiB of a new 1 MiB object were published as the file."""
    old, new = random_bytes(512 * 1024, seed=9), random_bytes(MiB, seed=10)
    nginx.write("m/w.bin", old)
    fault_proxy.drop_response_headers = set(VALIDATORS)
    if framing == "close-delimited":
        fault_proxy.drop_response_headers.add("content-length")
    seen = _replace_on_nth_get(fault_proxy, nginx, "m/w.bin", 1, new)
    uri = fault_proxy.url("m/w.bin")
    root = tmp_path / "root"
    caught_by = "size is now 1048576 bytes" if framing == "content-length" else "body goes on past the listed size"
    with pytest.raises(SourceChangedError, match=caught_by):
        _pull(uri, root)
    assert seen == [None], "the file was not read by one whole-file GET"
    assert not NodeStore.at(root).is_present(storage_key(uri))


def test_server_without_validators_is_probed_again_once_the_file_is_read(
    fault_proxy: FaultProxy, nginx: NginxServer
) -> None:
    """A source with no validator is looked at again at the end of each file: a change after its
    last response began shows nowhere else."""
    nginx.write("m/w.bin", random_bytes(MiB, seed=12))
    fault_proxy.drop_response_headers = set(VALIDATORS)
    with open_source(fault_proxy.url("m/w.bin"), Settings.from_env({})) as source:
        (listed,) = source.list_files()
        source.check_unchanged(listed)  # nothing changed
        nginx.write("m/w.bin", random_bytes(MiB + 1, seed=13))
        with pytest.raises(SourceChangedError, match="size is now 1048577 bytes, listed 1048576"):
            source.check_unchanged(listed)


def test_weak_etag_alone_is_no_resume_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weak ETag promises equivalent content, not the same bytes: alone it cannot say that a
    staged download belongs to the file listed now (it was the version, so it could)."""
    from modelcache.sources.http import _Listing

    with open_source("http://127.0.0.1:9/m/w.bin", Settings.from_env({})) as source:
        monkeypatch.setattr(source, "_look", lambda: _Listing(MiB, 'W/"abc"', None, True, []))
        assert source.list_files()[0].version is None
        monkeypatch.setattr(source, "_look", lambda: _Listing(MiB, 'W/"abc"', "Tue, 01 Dec 2026 10:00:00 GMT",
                                                              True, []))
        assert source.list_files()[0].version == 'last-modified Tue, 01 Dec 2026 10:00:00 GMT W/"abc"'


@pytest.fixture
def norange_proxy(nginx: NginxServer) -> Iterator[FaultProxy]:
    """The proxy in front of nginx's listener that ignores Range (one stream per file)."""
    proxy = FaultProxy(("127.0.0.1", nginx.ports["norange"]))
    try:
        yield proxy
    finally:
        proxy.close()


def test_body_of_unknown_length_cut_short_is_refused_without_a_checksum(
    norange_proxy: FaultProxy, nginx: NginxServer, tmp_path: Path
) -> None:
    """Point 10: with neither Content-Length nor chunked framing the body ends when the connection
    closes, so a cut connection looked like the end of the file and the truncated file was
    published."""
    data = random_bytes(3 * MiB, seed=15)
    nginx.write("m/w.bin", data)
    norange_proxy.drop_response_headers = {"content-length"}
    norange_proxy.add(Fault("truncate", path="/m/w.bin", at=MiB + 7))
    uri = norange_proxy.url("m/w.bin")
    root = tmp_path / "root"
    with pytest.raises(SourceError, match=r"neither Content-Length nor chunked framing.*#sha256="):
        _pull(uri, root)
    assert not NodeStore.at(root).is_present(storage_key(uri))
    # With the digest pinned the cut is caught by it, and the file is fetched again whole.
    pinned = uri + "#sha256=" + hashlib.sha256(data).hexdigest()
    norange_proxy.add(Fault("truncate", path="/m/w.bin", at=MiB + 7))
    res = _pull(pinned, root)
    assert (res.path / "w.bin").read_bytes() == data
    assert norange_proxy.faults["truncate"] == 2


# ---- the object stores' ranged reads (shared checks in modelcache/sources/ranges.py) -----------


@pytest.mark.parametrize("read", ["range", "whole"])
def test_s3_store_that_ignores_if_match_cannot_mix_an_overwritten_object(moto_s3_open: str, read: str) -> None:
    """S3-compatible stores do not all honour IfMatch; the answer's ETag, Content-Range total and
    Content-Length were not compared with the listing (the end checksum caught it only where
    there was one: not for SSE-KMS objects, whose ETag is no MD5)."""
    import boto3

    admin = boto3.client("s3", endpoint_url=moto_s3_open, region_name="us-east-1",
                         aws_access_key_id="a", aws_secret_access_key="b")
    bucket = f"changing-{os.getpid()}-{read}"
    admin.create_bucket(Bucket=bucket, ACL="public-read")
    admin.put_object(Bucket=bucket, Key="m/w.bin", Body=random_bytes(MiB, seed=16), ACL="public-read")
    host, port = moto_s3_open.rsplit(":", 1)
    with FaultProxy((host.removeprefix("http://"), int(port))) as proxy:
        proxy.drop_request_headers = set(CONDITIONS)
        env = {"AWS_ENDPOINT_URL": proxy.base_url, "awsAnonymousCredential": "true", "AWS_DEFAULT_REGION": "us-east-1"}
        with open_source(f"s3://{bucket}/m", Settings.from_env(env)) as source:
            (listed,) = source.list_files()
            admin.put_object(Bucket=bucket, Key="m/w.bin", Body=random_bytes(MiB + 9, seed=17), ACL="public-read")
            end = None if read == "whole" else MiB // 2
            with pytest.raises(SourceChangedError, match="ETag is now"):
                read_range(source, listed, 0 if read == "whole" else 4096, end)
        assert any(r.method == "GET" and r.status in (200, 206) for r in proxy.records), "If-Match was not dropped"


@pytest.mark.parametrize(("header", "size", "error"), [
    ("bytes 0-99/1000", 1000, None),
    ("bytes 0-99/*", 1000, None),
    ("bytes 0-99/1001", 1000, "its size is now 1001 bytes, listed 1000"),
    ("bytes 0-99/1000", None, None),
    (None, 1000, None),  # no header: the caller checks the start and refuses the answer
])
def test_content_range_total_is_held_against_the_listed_size(header: str | None, size: int | None,
                                                             error: str | None) -> None:
    if error is None:
        check_total("s3://b/k", header, size)
        return
    with pytest.raises(SourceChangedError, match=error):
        check_total("s3://b/k", header, size)
    assert parse_content_range("bytes 5-9/*") == (5, 9, None)
    assert parse_content_range("bytes 5-/10") is None
