"""The fault proxy does what the fault tests rely on: each fault really happens, and only when asked."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import urllib3

from tests.faultproxy import Fault, FaultProxy
from tests.fixtures.http import NginxServer

SIZE = 1 << 20


@pytest.fixture
def served(nginx: NginxServer) -> bytes:
    nginx.write("m/w.bin", SIZE, seed=7)
    return (nginx.docroot / "m/w.bin").read_bytes()


def fetch(
    url: str, headers: dict[str, str] | None = None, read_timeout: float = 10, piece: int = 32 * 1024
) -> tuple[int, bytes, Exception | None]:
    """GET through urllib3, keeping what arrived before an error."""
    with urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=5, read=read_timeout)) as pm:
        got = bytearray()
        resp = pm.request("GET", url, headers=headers, preload_content=False)
        try:
            for data in resp.stream(piece):
                got += data
        except Exception as exc:
            return resp.status, bytes(got), exc
        return resp.status, bytes(got), None


def raw_get(port: int, path: str, extra: str = "") -> tuple[bytes, bytes, BaseException | None]:
    """GET over a bare socket: returns (head, body, error) so RST and FIN are told apart exactly."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n".encode())
    data = bytearray()
    err: BaseException | None = None
    try:
        while True:
            piece = s.recv(65536)
            if not piece:
                break
            data += piece
    except OSError as exc:
        err = exc
    finally:
        s.close()
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    return head, body, err


def test_pass_through_whole_and_ranged_with_keepalive(fault_proxy: FaultProxy, served: bytes) -> None:
    status, body, err = fetch(fault_proxy.url("m/w.bin"))
    assert (status, err) == (200, None) and body == served
    with urllib3.PoolManager(retries=False) as pm:
        for start in (0, 1000, SIZE - 10):
            r = pm.request("GET", fault_proxy.url("m/w.bin"), headers={"Range": f"bytes={start}-{start + 9}"})
            assert r.status == 206 and r.data == served[start:start + 10]
    assert fault_proxy.requests["/m/w.bin"] == 4
    assert fault_proxy.bytes_sent["/m/w.bin"] == SIZE + 30
    assert fault_proxy.connections == 2  # the three ranged GETs shared one kept-alive connection
    assert not fault_proxy.faults


def test_reset_mid_body_sends_rst(fault_proxy: FaultProxy, served: bytes) -> None:
    fault_proxy.add(Fault("reset", path="/m/w.bin", at=300_000))
    head, body, err = raw_get(fault_proxy.port, "/m/w.bin")
    assert b"200 OK" in head and f"Content-Length: {SIZE}".encode() in head
    assert isinstance(err, ConnectionResetError)
    assert len(body) <= 300_000 and body == served[: len(body)]
    assert fault_proxy.faults["reset"] == 1
    # Once: the next request passes.
    _status, body, err = fetch(fault_proxy.url("m/w.bin"))
    assert err is None and body == served


def test_reset_seen_by_urllib3(fault_proxy: FaultProxy, served: bytes) -> None:
    fault_proxy.add(Fault("reset", path="/m/w.bin"))
    status, body, err = fetch(fault_proxy.url("m/w.bin"))
    assert status == 200 and err is not None and len(body) < SIZE


def test_truncate_closes_cleanly_short_of_content_length(fault_proxy: FaultProxy, served: bytes) -> None:
    fault_proxy.add(Fault("truncate", path="/m/w.bin", at=123_457))
    head, body, err = raw_get(fault_proxy.port, "/m/w.bin")
    assert err is None  # a clean FIN, not a reset
    assert f"Content-Length: {SIZE}".encode() in head
    assert body == served[:123_457]
    fault_proxy.add(Fault("truncate", path="/m/w.bin"))
    _status, body, err = fetch(fault_proxy.url("m/w.bin"))
    assert isinstance(err, urllib3.exceptions.ProtocolError) and len(body) == SIZE // 2


def test_flip_one_byte_at_file_offset_in_a_range(fault_proxy: FaultProxy, served: bytes) -> None:
    fault_proxy.add(Fault("flip", path="/m/w.bin", file_offset=700_001))
    # A range that does not cover the byte is untouched and leaves the rule armed.
    status, body, err = fetch(fault_proxy.url("m/w.bin"), {"Range": "bytes=0-99999"})
    assert (status, err) == (206, None) and body == served[:100_000]
    status, body, err = fetch(fault_proxy.url("m/w.bin"), {"Range": "bytes=600000-799999"})
    assert (status, err) == (206, None) and len(body) == 200_000
    diff = [i for i in range(len(body)) if body[i] != served[600_000 + i]]
    assert diff == [100_001]
    assert body[100_001] == served[700_001] ^ 0xFF
    assert fault_proxy.faults["flip"] == 1
    _, body, _ = fetch(fault_proxy.url("m/w.bin"), {"Range": "bytes=600000-799999"})
    assert body == served[600_000:800_000]


def test_status_n_times_then_pass(fault_proxy: FaultProxy, served: bytes) -> None:
    fault_proxy.add(Fault("status", path="/m/w.bin", status=503, times=2, retry_after=1))
    with urllib3.PoolManager(retries=False) as pm:
        first = pm.request("GET", fault_proxy.url("m/w.bin"))
        second = pm.request("GET", fault_proxy.url("m/w.bin"))
        third = pm.request("GET", fault_proxy.url("m/w.bin"))
    assert [first.status, second.status, third.status] == [503, 503, 200]
    assert first.headers["Retry-After"] == "1"
    assert third.data == served
    assert fault_proxy.faults["status"] == 2


def test_nth_request_only_and_other_paths_untouched(fault_proxy: FaultProxy, nginx: NginxServer, served: bytes) -> None:
    nginx.write("m/other.bin", b"x" * 1000)
    fault_proxy.add(Fault("status", path="/m/w.bin", status=500, nth=3))
    codes = []
    with urllib3.PoolManager(retries=False) as pm:
        for _ in range(4):
            codes.append(pm.request("GET", fault_proxy.url("m/other.bin")).status)
            codes.append(pm.request("GET", fault_proxy.url("m/w.bin")).status)
    assert codes == [200, 200, 200, 200, 200, 500, 200, 200]


def test_stall_trips_a_read_timeout_and_otherwise_delays(fault_proxy: FaultProxy, served: bytes) -> None:
    fault_proxy.add(Fault("stall", path="/m/w.bin", stall_seconds=1.5, at=10_000))
    t0 = time.monotonic()
    _status, body, err = fetch(fault_proxy.url("m/w.bin"), read_timeout=0.4, piece=1000)
    assert isinstance(err, urllib3.exceptions.ReadTimeoutError), err
    assert len(body) == 10_000 and time.monotonic() - t0 < 1.4
    fault_proxy.add(Fault("stall", path="/m/w.bin", stall_seconds=0.6))
    t0 = time.monotonic()
    _status, body, err = fetch(fault_proxy.url("m/w.bin"))
    assert err is None and body == served and time.monotonic() - t0 >= 0.6


def test_rate_limit_slows_delivery(fault_proxy: FaultProxy, served: bytes) -> None:
    fault_proxy.set_rate_limit(4 << 20)
    t0 = time.monotonic()
    _status, body, err = fetch(fault_proxy.url("m/w.bin"))
    assert err is None and body == served
    assert time.monotonic() - t0 >= 0.2  # 1 MiB at 4 MiB/s, minus the initial burst


def test_upstream_statuses_pass_through(fault_proxy: FaultProxy) -> None:
    with urllib3.PoolManager(retries=False) as pm:
        assert pm.request("GET", fault_proxy.url("status/403/x")).status == 403
        assert pm.request("GET", fault_proxy.url("nope.bin")).status == 404
        assert pm.request("HEAD", fault_proxy.url("status/401/x")).status == 401


def test_pause_holds_bodies_until_resume(fault_proxy: FaultProxy, served: bytes) -> None:
    fault_proxy.pause()
    result: list[tuple[int, bytes, Exception | None]] = []
    t = threading.Thread(target=lambda: result.append(fetch(fault_proxy.url("m/w.bin"))))
    t.start()
    time.sleep(0.4)
    assert fault_proxy.total_bytes_sent == 0 and not result
    fault_proxy.resume()
    t.join(timeout=10)
    assert result and result[0][1] == served
