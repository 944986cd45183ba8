"""The HDFS/WebHDFS source against the WebHDFS test server: listing, ranged OPEN through the
datanode redirect, KServe's secret-dir settings, and each error's message."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    NotFoundError,
    SourceError,
    TransientError,
)
from modelcache.sources.base import open_source
from modelcache.sources.credentials import Settings
from modelcache.sources.integrity import new_hasher
from tests.fixtures.hdfs import hdfs_settings
from tests.helpers import free_port
from tests.objectstore_data import read_range
from tests.webhdfs import WebHDFSServer


def test_nested_listing_and_ranged_reads(webhdfs: WebHDFSServer, tmp_path: Path) -> None:
    big = os.urandom(2_500_000)
    webhdfs.put("/models/bert/config.json", b"{}")
    webhdfs.put("/models/bert/weights/shard/model.bin", big)
    webhdfs.put("/models/bert/empty.txt", b"")
    settings = hdfs_settings(
        tmp_path, HDFS_NAMENODE=webhdfs.url, USER_PROXY="svc", HEADERS=json.dumps({"X-Trace": "abc"})
    )
    with open_source("hdfs://models/bert", settings) as src:
        files = src.list_files()
        assert [(f.path, f.size) for f in files] == [
            ("config.json", 2),
            ("empty.txt", 0),
            ("weights/shard/model.bin", len(big)),
        ]
        f = files[2]
        parts = [read_range(src, f, s, min(s + 1_000_000, len(big))) for s in range(0, len(big), 1_000_000)]
        assert b"".join(parts) == big
        assert read_range(src, f, 2_000_000, None) == big[2_000_000:]
    opens = [r for r in webhdfs.ops("datanode") if r.op == "OPEN"]
    assert {(r.params["offset"], r.params["length"]) for r in opens} >= {("1000000", "1000000"), ("2000000", "500000")}
    assert all(r.params.get("doas") == "svc" and r.headers.get("x-trace") == "abc" for r in webhdfs.ops())
    assert any(r.op == "LISTSTATUS" and r.path.endswith("/models/bert/weights") for r in webhdfs.ops("namenode"))


def test_single_file_and_root_path(webhdfs: WebHDFSServer, tmp_path: Path) -> None:
    webhdfs.put("/user/alice/models/one/model.onnx", b"onnx!")
    settings = hdfs_settings(tmp_path, HDFS_NAMENODE=webhdfs.url, HDFS_ROOTPATH="/user/alice")
    with open_source("webhdfs://models/one/model.onnx", settings) as src:
        (f,) = src.list_files()
        assert (f.path, f.size) == ("model.onnx", 5)
        assert read_range(src, f, 0, None) == b"onnx!"


def test_file_shrunk_after_listing_is_a_short_read(webhdfs: WebHDFSServer, tmp_path: Path) -> None:
    webhdfs.put("/m/w.bin", b"x" * 10_000)
    with open_source("hdfs://m", hdfs_settings(tmp_path, HDFS_NAMENODE=webhdfs.url)) as src:
        (f,) = src.list_files()
        webhdfs.put("/m/w.bin", b"x" * 4_000)
        with pytest.raises(TransientError, match="ended after 4000 of 10000 bytes"):
            read_range(src, f, 0, 10_000)


def test_gateway_without_reserved_inode_paths_reads_by_path(webhdfs: WebHDFSServer, tmp_path: Path) -> None:
    """Reads go through /.reserved/.inodes/<fileId>; a gateway that does not serve those paths
    (404 for a file that is still there, unchanged) is read by path instead, not called changed."""
    webhdfs.put("/m/w.bin", b"0123456789")
    webhdfs.reserved_paths = False
    with open_source("hdfs://m", hdfs_settings(tmp_path, HDFS_NAMENODE=webhdfs.url)) as src:
        (f,) = src.list_files()
        assert read_range(src, f, 2, 6) == b"2345"
        assert read_range(src, f, 6, None) == b"6789"
    opens = [r.path for r in webhdfs.ops("namenode") if r.op == "OPEN"]
    assert opens[0].startswith("/webhdfs/v1/.reserved/.inodes/") and opens[1:] == ["/webhdfs/v1/m/w.bin"] * 2, opens


def test_error_messages(webhdfs: WebHDFSServer, tmp_path: Path) -> None:
    webhdfs.put("/models/m/a.bin", b"a")
    (webhdfs.root / "models/emptydir").mkdir(parents=True)
    ok = hdfs_settings(tmp_path, HDFS_NAMENODE=webhdfs.url)

    def fail(uri: str, settings: Settings, exc: type[Exception], needle: str) -> None:
        with pytest.raises(exc) as err, open_source(uri, settings) as src:
            src.list_files()
        msg = str(err.value)
        assert needle in msg and uri in msg and "\n" not in msg, msg

    fail("hdfs://models/missing", ok, NotFoundError, "'/models/missing' not found")
    fail("hdfs://models/emptydir", ok, NotFoundError, "No model found")
    webhdfs.required_headers = {"X-Gateway-Token": "s3cr3t"}
    fail("hdfs://models/m", ok, AuthError, "authentication failed")
    with_header = hdfs_settings(tmp_path / "h", HDFS_NAMENODE=webhdfs.url, HEADERS='{"X-Gateway-Token": "s3cr3t"}')
    with open_source("hdfs://models/m", with_header) as src:
        assert [f.path for f in src.list_files()] == ["a.bin"]
    webhdfs.denied_paths = {"/models/m"}
    fail("hdfs://models/m", with_header, AccessDeniedError, "access to '/models/m' denied")
    fail("hdfs://models/m", hdfs_settings(tmp_path / "e"), SourceError, "HDFS_NAMENODE")
    dead = hdfs_settings(tmp_path / "d", HDFS_NAMENODE=f"http://127.0.0.1:{free_port()}")
    fail("hdfs://models/m", dead, TransientError, "cannot reach WebHDFS")


def test_ha_namenodes_fall_over(webhdfs: WebHDFSServer, tmp_path: Path) -> None:
    webhdfs.put("/models/m/a.bin", b"abc")
    settings = hdfs_settings(tmp_path, HDFS_NAMENODE=f"http://127.0.0.1:{free_port()};{webhdfs.url}")
    with open_source("hdfs://models/m", settings) as src:
        (f,) = src.list_files()
        assert read_range(src, f, 1, 3) == b"bc"


@pytest.mark.parametrize("size", [1, 511, 512, 700_000, 1 << 20, (1 << 20) + 1, 2_500_000, 3 << 20])
def test_hdfs_checksum_matches_the_datanodes(webhdfs: WebHDFSServer, tmp_path: Path, size: int) -> None:
    """The incremental hasher (fed in odd-sized pieces) equals the server's plain computation,
    for one block, block boundaries and several blocks; one flipped byte changes it."""
    data = os.urandom(size)
    webhdfs.put("/c/f.bin", data)
    with open_source("hdfs://c", hdfs_settings(tmp_path, HDFS_NAMENODE=webhdfs.url)) as src:
        (f,) = src.list_files()
    (checksum,) = f.checksums
    assert checksum.algo == "hdfs-md5md5crc" and checksum.param("block_size") == str(1 << 20)
    h = new_hasher(checksum, size)
    for i in range(0, size, 77_777):
        h.update(memoryview(data)[i : i + 77_777])
    assert h.hexdigest() == checksum.value
    bad = bytearray(data)
    bad[size // 2] ^= 1
    h2 = new_hasher(checksum, size)
    h2.update(bytes(bad))
    assert h2.hexdigest() != checksum.value


def _client_cert(folder: Path) -> tuple[Path, Path, Path]:
    """A client CA and a certificate signed by it (trustme; EKU clientAuth among others): (ca, cert, key)."""
    import trustme

    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="webhdfs client CA")
    client = ca.issue_cert("svc")
    paths = (folder / "client-ca.pem", folder / "client.pem", folder / "client.key")
    ca.cert_pem.write_to_path(str(paths[0]))
    client.cert_chain_pems[0].write_to_path(str(paths[1]))
    client.private_key_pem.write_to_path(str(paths[2]))
    return paths


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_tls_settings_from_the_secret_dir(tmp_path: Path) -> None:
    """TLS_CA, TLS_SKIP_VERIFY and TLS_CERT/TLS_KEY (files of the secret dir, as KServe passes
    them to requests) against a WebHDFS server on HTTPS that demands a client certificate;
    the datanode redirect is HTTPS too."""
    from tests.fixtures.http import make_tls

    tls = make_tls(tmp_path / "server-tls")
    client_ca, client_cert, client_key = _client_cert(tmp_path / "client-tls")
    server = WebHDFSServer(
        root=tmp_path / "ns", tls_cert=tls.cert_path, tls_key=tls.key_path, client_ca=client_ca
    ).start()
    try:
        data = os.urandom(300_000)
        server.put("/models/m/w.bin", data)
        assert server.url.startswith("https://") and server.datanode_url.startswith("https://")
        pem = {"TLS_CERT": client_cert.read_text(), "TLS_KEY": client_key.read_text()}
        for name, files in (
            ("ca", {"TLS_CA": tls.ca_path.read_text(), **pem}),
            ("skip", {"TLS_SKIP_VERIFY": "true", **pem}),
        ):
            settings = hdfs_settings(tmp_path / name, HDFS_NAMENODE=server.url, **files)
            with open_source("hdfs://models/m", settings) as src:
                (f,) = src.list_files()
                assert read_range(src, f, 100, 250_000) == data[100:250_000]
        assert any(r.op == "OPEN" for r in server.ops("datanode"))

        def refused(name: str, **files: str) -> str:
            with pytest.raises(SourceError) as err, open_source(
                "hdfs://models/m", hdfs_settings(tmp_path / name, HDFS_NAMENODE=server.url, **files)
            ) as src:
                src.list_files()
            msg = str(err.value)
            assert "hdfs://models/m" in msg and "TLS" in msg and "\n" not in msg, msg
            assert not isinstance(err.value, TransientError), msg
            return msg

        refused("no-ca", **pem)  # the server's CA is not trusted
        refused("no-client-cert", TLS_CA=tls.ca_path.read_text())  # the server wants a client certificate
    finally:
        server.stop()


def test_rate_limited_gateway(webhdfs: WebHDFSServer, tmp_path: Path) -> None:
    """429 with Retry-After (a gateway in front of WebHDFS): the listing waits and lists
    again, a persistent one fails naming the URI, reads raise a retryable error carrying
    Retry-After for the engine; 503 is transient."""
    import time

    from modelcache.errors import RateLimitedError

    webhdfs.put("/models/m/a.bin", b"abc")
    settings = hdfs_settings(tmp_path, HDFS_NAMENODE=webhdfs.url)
    webhdfs.fail(429, retry_after=1, when=lambda r: r.op == "LISTSTATUS")
    started = time.monotonic()
    with open_source("hdfs://models/m", settings) as src:
        (f,) = src.list_files()
        assert time.monotonic() - started >= 0.95
        assert len([r for r in webhdfs.ops() if r.op == "LISTSTATUS"]) == 2
        webhdfs.fail(429, retry_after=7, when=lambda r: r.op == "OPEN" and r.node == "datanode")
        with pytest.raises(RateLimitedError) as err:
            read_range(src, f, 0, 3)
        assert err.value.retry_after == 7 and err.value.retryable and "hdfs://models/m" in str(err.value)
        webhdfs.fail(503, when=lambda r: r.op == "OPEN")
        with pytest.raises(TransientError, match="503"):
            read_range(src, f, 0, 3)
        assert read_range(src, f, 1, 3) == b"bc"
    before = len([r for r in webhdfs.ops() if r.op == "GETFILESTATUS"])
    webhdfs.fail(429, retry_after=0, count=100, when=lambda r: r.op == "GETFILESTATUS")
    with pytest.raises(RateLimitedError) as err, open_source("hdfs://models/m", settings) as src:
        src.list_files()
    msg = str(err.value)
    assert "hdfs://models/m" in msg and "429" in msg and "\n" not in msg, msg
    assert len([r for r in webhdfs.ops() if r.op == "GETFILESTATUS"]) - before == 5
