"""The WebHDFS test server, driven by the official ``hdfs`` client so it cannot drift from
what real clients expect of a namenode/datanode pair."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hdfs import Client, HdfsError, InsecureClient

from tests.webhdfs import WebHDFSServer


def test_client_round_trip(webhdfs: WebHDFSServer, tmp_path: Path) -> None:
    client = InsecureClient(webhdfs.url, user="alice")
    data = os.urandom(3_000_000)
    src = tmp_path / "up"
    (src / "sub").mkdir(parents=True)
    (src / "sub/w.bin").write_bytes(data)
    (src / "config.json").write_bytes(b"{}")
    client.upload("/models/m1", str(src), n_threads=2)
    assert client.status("/models/m1")["type"] == "DIRECTORY"
    assert client.status("/models/m1/sub/w.bin")["length"] == len(data)
    assert sorted(client.list("/models/m1")) == ["config.json", "sub"]
    with client.read("/models/m1/sub/w.bin", offset=1_000_000, length=250_000) as r:
        assert r.read() == data[1_000_000:1_250_000]
    # relative paths resolve against the home directory (GETHOMEDIRECTORY)
    client.write("notes.txt", data=b"hello")
    assert client.status("/user/alice/notes.txt")["length"] == 5
    out = tmp_path / "down"
    client.download("/models/m1", str(out), n_threads=2)
    assert (out / "sub/w.bin").read_bytes() == data
    assert client.checksum("/models/m1/config.json")["algorithm"].startswith("MD5-of-")
    assert client.status("/nope", strict=False) is None
    with pytest.raises(HdfsError) as err:
        client.status("/nope")
    assert err.value.exception == "FileNotFoundException"
    # OPEN went namenode -> 307 -> datanode with offset/length (no HTTP Range)
    opens = [r for r in webhdfs.ops("datanode") if r.op == "OPEN"]
    assert any(r.params.get("offset") == "1000000" and r.params.get("length") == "250000" for r in opens)
    assert all("range" not in r.headers for r in opens)
    # an injected 429 reaches the client as an error, with Retry-After on the response
    webhdfs.fail(429, retry_after=3, when=lambda r: r.op == "GETFILESTATUS")
    with pytest.raises(HdfsError):
        client.status("/models/m1")
    assert client.status("/models/m1")["type"] == "DIRECTORY"
    import requests

    url = f"{webhdfs.url}/webhdfs/v1/models/m1?op=GETFILESTATUS"
    webhdfs.fail(429, retry_after=3)
    resp = requests.get(url, timeout=10)
    assert resp.status_code == 429 and resp.headers["Retry-After"] == "3"
    assert client.delete("/models/m1", recursive=True)
    assert client.status("/models/m1", strict=False) is None


def test_client_sees_auth_errors(webhdfs: WebHDFSServer) -> None:
    webhdfs.put("/secure/a.txt", b"a")
    webhdfs.required_headers = {"X-Gateway-Token": "t0k"}
    with pytest.raises(HdfsError, match="Authentication failure"):
        InsecureClient(webhdfs.url, user="bob").status("/secure/a.txt")
    import requests

    session = requests.Session()
    session.headers["X-Gateway-Token"] = "t0k"
    client = InsecureClient(webhdfs.url, user="bob", session=session)
    assert client.status("/secure/a.txt")["length"] == 1
    webhdfs.denied_paths = {"/secure"}
    with pytest.raises(HdfsError) as err:
        client.status("/secure/a.txt")
    assert err.value.exception == "AccessControlException"
    webhdfs.denied_paths = set()
    webhdfs.allowed_users = {"svc"}
    with pytest.raises(HdfsError) as err:
        client.read("/secure/a.txt").__enter__()
    assert err.value.exception == "AccessControlException"
    proxied = Client(webhdfs.url, proxy="svc", session=session)  # doas=svc, as KServe builds it
    with proxied.read("/secure/a.txt") as r:
        assert r.read() == b"a"
