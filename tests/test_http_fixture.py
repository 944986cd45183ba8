"""The nginx fixture itself: every listener and special location behaves as the other tests assume."""

from __future__ import annotations

import hashlib

import requests

from tests.fixtures.http import NginxServer
from tests.helpers import wait_until


def test_ranges_norange_and_log(nginx: NginxServer) -> None:
    nginx.write("d/x.bin", 1000)
    body = (nginx.docroot / "d/x.bin").read_bytes()
    r = requests.get(nginx.url("d/x.bin"), headers={"Range": "bytes=10-19"}, timeout=5)
    assert r.status_code == 206 and r.content == body[10:20]
    r = requests.get(nginx.url("d/x.bin", "norange"), headers={"Range": "bytes=10-19"}, timeout=5)
    assert r.status_code == 200 and r.content == body
    # nginx writes a request's log line after its response: the client can read the body first
    # (a CI run read the log with the second line not yet there).
    wait_until(lambda: len(nginx.requests_for("d/x.bin")) >= 2, timeout=5, what="both log lines")
    log = nginx.requests_for("d/x.bin")
    assert [(e.status, e.bytes_sent, e.range) for e in log] == [(206, 10, "bytes=10-19"), (200, 1000, "bytes=10-19")]


def test_https_with_fixture_ca(nginx: NginxServer) -> None:
    nginx.write("a.bin", b"hello")
    r = requests.get(nginx.url("a.bin", "https"), verify=str(nginx.ca_path), timeout=5)
    assert r.content == b"hello"
    try:
        requests.get(nginx.url("a.bin", "https"), timeout=5)
    except requests.exceptions.SSLError:
        pass
    else:
        raise AssertionError("an unknown CA must be rejected")


def test_headers_auth_and_status(nginx: NginxServer) -> None:
    digest = hashlib.sha256(b"abc").hexdigest()
    nginx.write("m/a.bin", b"abc", headers={"X-Checksum-Sha256": digest, "Content-MD5": "kAFQmDzST7DWlj99KOF/cg=="})
    r = requests.get(nginx.url("m/a.bin"), timeout=5)
    assert r.headers["X-Checksum-Sha256"] == digest and r.headers["Content-MD5"] == "kAFQmDzST7DWlj99KOF/cg=="
    nginx.write("m/b.bin", b"b")
    assert "Content-MD5" not in requests.get(nginx.url("m/b.bin"), timeout=5).headers
    assert requests.get(nginx.url("auth/m/a.bin"), timeout=5).status_code == 401
    name, value = nginx.auth_header
    r = requests.get(nginx.url("auth/m/a.bin"), headers={name: value}, timeout=5)
    assert r.status_code == 200 and r.content == b"abc"
    for code in (401, 403, 404, 503):
        assert requests.get(nginx.url(f"status/{code}/m/a.bin"), timeout=5).status_code == code
