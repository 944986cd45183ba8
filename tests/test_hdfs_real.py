"""The HDFS/WebHDFS source against a real HDFS (Hadoop's MiniDFSCluster, tests/fixtures/hdfs.py):
listing, ranged reads through the NameNode's 307 to the DataNode, GETFILECHECKSUM as a real
DataNode computes it, missing paths, permissions, USER_PROXY (doas), a file replaced during a
pull, and `modelcache pull` end to end. What the real cluster cannot be made to do (429/5xx from
a gateway, a corrupted byte in flight, TLS client certificates, throttled streams for kill -9)
stays on tests/webhdfs (test_hdfs_source.py, test_hdfs_pull.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from modelcache.errors import AccessDeniedError, NotFoundError, SourceError
from modelcache.sources.base import open_source
from modelcache.sources.credentials import Settings
from modelcache.sources.integrity import new_hasher
from modelcache.sources.uri import storage_key
from tests.fixtures.hdfs import MiniHDFS, hdfs_settings
from tests.helpers import REPO
from tests.objectstore_data import read_range
from tests.pull_helpers import error_line, manifest_of, model_files, pull_cmd

MiB = 1 << 20


def settings_for(tmp_path: Path, cluster: MiniHDFS, **files: str) -> Settings:
    return hdfs_settings(tmp_path, HDFS_NAMENODE=cluster.url, **files)


def record_responses(src) -> list[requests.Response]:
    """Every response the source's session receives (redirects in ``.history``)."""
    seen: list[requests.Response] = []

    def hook(resp: requests.Response, *args: object, **kwargs: object) -> requests.Response:
        seen.append(resp)
        return resp

    src._session.hooks["response"].append(hook)
    return seen


def record_pool(src) -> list[str]:
    """Every URL the source's data path requests."""
    urls: list[str] = []
    real = src._pool.request

    def request(method: str, url: str, **kwargs: object) -> object:
        urls.append(url)
        return real(method, url, **kwargs)

    src._pool.request = request
    return urls


def test_listing_ranged_reads_through_the_datanode_and_checksums(mini_hdfs: MiniHDFS, tmp_path: Path) -> None:
    top = mini_hdfs.folder()
    big = os.urandom(2 * MiB + 123_457)  # three 1 MiB blocks, the last one partial
    files = {"config.json": b'{"a": 1}', "weights/shard/model.bin": big, "empty.txt": b""}
    for rel, data in files.items():
        mini_hdfs.put(f"{top}/m/{rel}", data)
    uri = f"hdfs:/{top}/m"
    with open_source(uri, settings_for(tmp_path, mini_hdfs)) as src:
        listed = src.list_files()
        assert [(f.path, f.size) for f in listed] == [
            ("config.json", 8),
            ("empty.txt", 0),
            ("weights/shard/model.bin", len(big)),
        ]
        f = listed[2]
        # The listing carries the DataNode's own checksum, and our incremental hasher agrees.
        (checksum,) = f.checksums
        assert checksum.algo == "hdfs-md5md5crc"
        real = mini_hdfs.checksum(f"{top}/m/weights/shard/model.bin")
        assert real["algorithm"] == "MD5-of-2048MD5-of-512CRC32C"
        assert checksum.value == real["bytes"][:56]
        h = new_hasher(checksum, len(big))
        for i in range(0, len(big), 99_999):
            h.update(big[i : i + 99_999])
        assert h.hexdigest() == checksum.value
        seen = record_responses(src)
        datanode = record_pool(src)
        parts = [read_range(src, f, s, min(s + 700_000, len(big))) for s in range(0, len(big), 700_000)]
        assert b"".join(parts) == big
        assert read_range(src, f, len(big) - 10, None) == big[-10:]
    # Each read was answered by the DataNode after a 307 from the NameNode: the NameNode's
    # answer through the hdfs client's session, the DataNode's through the data path's pool.
    nn_port, dn_port = urlsplit(mini_hdfs.url).port, int(mini_hdfs.datanode.rsplit(":", 1)[1])
    redirects = [r for r in seen if "op=OPEN" in r.url]
    assert [(r.status_code, urlsplit(r.url).port) for r in redirects] == [(307, nn_port)] * 5
    assert [urlsplit(u).port for u in datanode] == [dn_port] * 5
    assert all("op=OPEN" in u for u in datanode)


@pytest.mark.parametrize("size", [1, 511, 512, MiB - 1, MiB, MiB + 1, 3 * MiB, 4 * MiB + 513])
def test_our_checksum_equals_the_datanodes(mini_hdfs: MiniHDFS, tmp_path: Path, size: int) -> None:
    """One, two, three, four and five blocks, block and CRC-chunk boundaries: the value a real
    DataNode answers to GETFILECHECKSUM is what our hasher computes; one flipped bit is not."""
    top = mini_hdfs.folder()
    data = os.urandom(size)
    mini_hdfs.put(f"{top}/f.bin", data)
    with open_source(f"hdfs:/{top}/f.bin", settings_for(tmp_path, mini_hdfs)) as src:
        (f,) = src.list_files()
    (checksum,) = f.checksums
    h = new_hasher(checksum, size)
    h.update(data)
    assert h.hexdigest() == checksum.value
    bad = bytearray(data)
    bad[size // 2] ^= 1
    h2 = new_hasher(checksum, size)
    h2.update(bytes(bad))
    assert h2.hexdigest() != checksum.value


def test_missing_path_empty_folder_and_permissions(mini_hdfs: MiniHDFS, tmp_path: Path) -> None:
    top = mini_hdfs.folder()
    mini_hdfs.put(f"{top}/private/m/a.bin", b"secret weights")
    mini_hdfs.client().makedirs(f"{top}/empty")
    mini_hdfs.chmod(f"{top}/private", "700")  # the superuser's; requests without user.name are dr.who

    def fail(uri: str, settings: Settings, exc: type[Exception], needle: str) -> str:
        with pytest.raises(exc) as err, open_source(uri, settings) as src:
            src.list_files()
        msg = str(err.value)
        assert needle in msg and uri in msg and "\n" not in msg, msg
        return msg

    plain = settings_for(tmp_path, mini_hdfs)
    fail(f"hdfs:/{top}/missing", plain, NotFoundError, f"'{top}/missing' not found")
    fail(f"hdfs:/{top}/empty", plain, NotFoundError, "No model found")
    msg = fail(f"webhdfs:/{top}/private/m", plain, AccessDeniedError, "denied")
    assert "dr.who" in msg  # HDFS's own reason: who was refused where
    # USER_PROXY: dr.who may act for others on this cluster (hadoop.proxyuser.dr.who.*), so
    # acting as the owner reads the folder.
    owner = settings_for(tmp_path / "owner", mini_hdfs, USER_PROXY=mini_hdfs.superuser)
    with open_source(f"webhdfs:/{top}/private/m", owner) as src:
        (f,) = src.list_files()
        assert read_range(src, f, 0, None) == b"secret weights"


def test_file_replaced_during_the_pull_is_never_mixed_in(mini_hdfs: MiniHDFS, tmp_path: Path) -> None:
    """HDFS has no versions: a file rewritten after the listing is a new inode. Reads go through
    the listed inode, so they fail with one clear line instead of returning the new bytes."""
    top = mini_hdfs.folder()
    old, new = os.urandom(MiB + 10), os.urandom(MiB + 10)  # same size: only the content differs
    mini_hdfs.put(f"{top}/m/w.bin", old)
    uri = f"hdfs:/{top}/m"
    with open_source(uri, settings_for(tmp_path, mini_hdfs)) as src:
        (f,) = src.list_files()
        assert read_range(src, f, 0, 100) == old[:100]
        mini_hdfs.put(f"{top}/m/w.bin", new)
        with pytest.raises(SourceError) as err:
            read_range(src, f, 100, 200)
    msg = str(err.value)
    assert uri in msg and "changed while it was being downloaded" in msg and "\n" not in msg, msg
    assert not err.value.retryable


def _pull(cluster: MiniHDFS, tmp_path: Path, uri: str, *args: str, **secret: str) -> subprocess.CompletedProcess:
    folder = tmp_path / "hdfscreds"
    folder.mkdir(exist_ok=True)
    for name, value in {"HDFS_NAMENODE": cluster.url, **secret}.items():
        (folder / name).write_text(value)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HDFS_", "STORAGE_"))}
    env["HDFS_SECRET_DIR"] = str(folder)
    return subprocess.run(
        pull_cmd(uri, tmp_path / "root", *args), env=env, cwd=REPO, capture_output=True, text=True, timeout=180
    )


@pytest.mark.parametrize("scheme", ["hdfs", "webhdfs"])
def test_pull_end_to_end_verified(mini_hdfs: MiniHDFS, tmp_path: Path, scheme: str) -> None:
    top = mini_hdfs.folder()
    files = {
        "config.json": b'{"model_type": "tiny"}',
        "weights/model-00001.bin": os.urandom(3 * MiB + 7),
        "weights/model-00002.bin": os.urandom(MiB),
        "tokenizer/vocab.txt": b"a\nb\n" * 300,
    }
    for rel, data in files.items():
        mini_hdfs.put(f"{top}/bert/{rel}", data)
    uri = f"{scheme}:/{top}/bert"
    proc = _pull(mini_hdfs, tmp_path, uri, "--chunk-size", "256K")
    assert proc.returncode == 0, proc.stderr
    assert model_files(tmp_path / "root", uri) == files
    manifest = manifest_of(tmp_path / "root", uri)
    checks = {f["path"]: f.get("checksums", {}) for f in manifest["files"]}  # type: ignore[union-attr]
    assert all("hdfs-md5md5crc" in checks[p] for p in files), checks
    again = _pull(mini_hdfs, tmp_path, uri)
    assert again.returncode == 0 and "cached" in again.stderr, again.stderr


def test_pull_errors_end_to_end(mini_hdfs: MiniHDFS, tmp_path: Path) -> None:
    top = mini_hdfs.folder()
    mini_hdfs.put(f"{top}/locked/a.bin", b"a")
    mini_hdfs.chmod(f"{top}/locked", "700")
    error_line(_pull(mini_hdfs, tmp_path, f"hdfs:/{top}/nothing"), f"hdfs:/{top}/nothing", "not found")
    error_line(_pull(mini_hdfs, tmp_path, f"hdfs:/{top}/locked"), f"hdfs:/{top}/locked", "denied")
    assert not (tmp_path / "root/models" / storage_key(f"hdfs:/{top}/locked")).exists()


def test_gateway_429_and_503_in_front_of_the_real_namenode(mini_hdfs: MiniHDFS, tmp_path: Path) -> None:
    """A gateway between us and the NameNode (tests/faultproxy.py) answers 429 with Retry-After to
    the listing and 503 to reads' first hop: the listing waits, the engine retries, and the pull
    completes against the real cluster. (Faults on the DataNode's hop stay on tests/webhdfs: the
    NameNode redirects reads straight to the DataNode, past any proxy in front of it.)"""
    from tests.faultproxy import Fault, FaultProxy

    top = mini_hdfs.folder()
    data = os.urandom(MiB + 99)
    mini_hdfs.put(f"{top}/m/w.bin", data)
    inode = mini_hdfs.client().status(f"{top}/m/w.bin")["fileId"]
    host, port = urlsplit(mini_hdfs.url).hostname, urlsplit(mini_hdfs.url).port
    proxy = FaultProxy((host, port))
    try:
        listing = proxy.add(Fault("status", path=f"/webhdfs/v1{top}/m", status=429, retry_after=1))
        reads = proxy.add(Fault("status", path=f"/webhdfs/v1/.reserved/.inodes/{inode}", status=503, times=2))
        gateway = MiniHDFS(proxy.base_url, mini_hdfs.datanode, mini_hdfs.superuser, mini_hdfs.log)
        uri = f"hdfs:/{top}/m"
        proc = _pull(gateway, tmp_path, uri, "--chunk-size", "256K")
        assert proc.returncode == 0, proc.stderr
        assert model_files(tmp_path / "root", uri) == {"w.bin": data}
        assert listing.applied == 1 and reads.applied == 2
    finally:
        proxy.close()
