"""The one HTTP data path (modelcache/sources/httpread.py), against a real server on 127.0.0.1:
the status classifier, Retry-After in seconds and as an HTTP date, the empty-range rule (no
request for no bytes), credentials kept to their host across redirects, answers held against
the listing, and abort() waking a reader blocked in recv."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    NotFoundError,
    RateLimitedError,
    SourceChangedError,
    SourceError,
    TransientError,
)
from modelcache.sources.httpread import Hints, make_pool, open_range, status_error
from modelcache.sources.remote import RemoteFile

BODY = bytes(range(256)) * 64  # 16 KiB


class Server:
    """Answers GETs with ``handler(request) -> (status, headers, body)``; records each request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.answer: Callable[[BaseHTTPRequestHandler], tuple[int, dict[str, str], bytes]] = self.ranged
        self.hold = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                status, headers, body = server.answer(self)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                if headers.get("X-Then-Hold"):
                    server.hold.wait(30)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, path: str = "/f", host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    @staticmethod
    def ranged(h: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        rng = h.headers.get("Range")
        if not rng:
            return 200, {}, BODY
        a, _, b = rng.removeprefix("bytes=").partition("-")
        start, end = int(a), int(b) if b else len(BODY) - 1
        return 206, {"Content-Range": f"bytes {start}-{end}/{len(BODY)}"}, BODY[start : end + 1]


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.hold.set()
    s.httpd.shutdown()
    s.httpd.server_close()


FILE = RemoteFile("f", len(BODY))


def read_all(stream: object) -> bytes:
    out = bytearray()
    buf = memoryview(bytearray(4096))
    while n := stream.readinto(buf):  # type: ignore[attr-defined]
        out += buf[:n]
    stream.close()  # type: ignore[attr-defined]
    return bytes(out)


def pool():  # type: ignore[no-untyped-def]
    return make_pool(True, 4, 5, 5)


@pytest.mark.parametrize(
    ("status", "error", "text"),
    [
        (401, AuthError, "HTTP 401 Unauthorized: log in"),
        (403, AccessDeniedError, "HTTP 403 Forbidden: ask for access"),
        (404, NotFoundError, "HTTP 404 Not Found: check it"),
        (410, NotFoundError, "HTTP 410 Not Found: check it"),
        (412, SourceChangedError, "changed on the server during the download; pull again"),
        (408, TransientError, "HTTP 408 from the server"),
        (500, TransientError, "HTTP 500 from the server"),
        (418, SourceError, "unexpected HTTP 418"),
    ],
)
def test_one_status_classifier(status: int, error: type, text: str) -> None:
    err = status_error(status, {}, "u://x", Hints(auth="log in", denied="ask for access", missing="check it"))
    assert type(err) is error and text in str(err) and str(err).startswith("u://x: ")


def test_429_and_503_carry_retry_after_in_seconds_or_as_an_http_date(server: Server) -> None:
    in_30s = formatdate(time.time() + 30, usegmt=True)
    for status, value in ((429, "7"), (429, in_30s), (503, "3")):
        server.answer = lambda h, s=status, v=value: (s, {"Retry-After": v}, b"slow down")
        with pytest.raises(RateLimitedError) as err:
            open_range(pool(), server.url(), FILE, 0, 100, "u://f")
        assert err.value.retry_after is not None
        assert 25 <= err.value.retry_after <= 31 if value == in_30s else err.value.retry_after == float(value)


def test_an_empty_range_makes_no_request(server: Server) -> None:
    for start, end, file in ((5, 5, FILE), (len(BODY), None, FILE), (0, None, RemoteFile("e", 0))):
        assert read_all(open_range(pool(), server.url(), file, start, end, "u://f")) == b""
    assert server.requests == []
    assert read_all(open_range(pool(), server.url(), FILE, 10, 20, "u://f")) == BODY[10:20]
    assert len(server.requests) == 1


def test_private_headers_stay_on_their_host_across_redirects(server: Server) -> None:
    def answer(h: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        if h.path == "/same":
            return 307, {"Location": "/data"}, b""
        if h.path == "/other":  # another host name for this server: another origin
            return 307, {"Location": server.url("/data", host="localhost")}, b""
        return Server.ranged(h)

    server.answer = answer
    for path in ("/same", "/other"):
        got = open_range(pool(), server.url(path), FILE, 0, 64, "u://f", headers={"X-Public": "p"},
                         private={"Authorization": "Bearer secret"})
        assert read_all(got) == BODY[:64]
    sent = {path: headers for path, headers in server.requests}
    assert [p for p, _ in server.requests] == ["/same", "/data", "/other", "/data"]
    first_data, second_data = (h for p, h in server.requests if p == "/data")
    assert first_data["authorization"] == "Bearer secret" and first_data["x-public"] == "p"
    assert "authorization" not in second_data and second_data["x-public"] == "p"
    assert sent["/other"]["authorization"] == "Bearer secret"


@pytest.mark.parametrize(
    ("answer", "error", "text"),
    [
        (lambda h: (200, {}, BODY), TransientError, "got HTTP 200 with the whole file"),
        (lambda h: (206, {"Content-Range": f"bytes 0-99/{len(BODY)}"}, BODY[:100]), TransientError,
         "asked for bytes from 100"),
        (lambda h: (206, {"Content-Range": "bytes 100-199/99999"}, BODY[100:200]), SourceChangedError,
         "its size is now 99999 bytes"),
        (lambda h: (206, {"Content-Range": f"bytes 100-199/{len(BODY)}", "Content-Length": "50"}, BODY[100:150]),
         TransientError, "does not match Content-Range"),
    ],
)
def test_answers_are_held_against_the_listing(server: Server, answer: Callable, error: type, text: str) -> None:
    server.answer = answer
    with pytest.raises(error, match=text):
        open_range(pool(), server.url(), FILE, 100, 200, "u://f")


def test_a_body_cut_short_is_transient_never_a_short_file(server: Server) -> None:
    server.answer = lambda h: (206, {"Content-Range": f"bytes 0-99/{len(BODY)}", "Connection": "close",
                                     "Content-Length": "100"}, BODY[:60])
    stream = open_range(pool(), server.url(), FILE, 0, 100, "u://f")
    with pytest.raises(TransientError, match="body ended after 60 of 100 bytes"):
        read_all(stream)


def test_abort_wakes_a_reader_blocked_in_recv(server: Server) -> None:
    server.answer = lambda h: (206, {"Content-Range": f"bytes 0-{len(BODY) - 1}/{len(BODY)}",
                                     "Content-Length": str(len(BODY)), "X-Then-Hold": "1"}, BODY[:1000])
    stream = open_range(make_pool(True, 4, 5, 60), server.url(), FILE, 0, None, "u://f")
    buf = memoryview(bytearray(len(BODY)))
    box: dict[str, BaseException | int] = {}

    def reader() -> None:
        try:
            while True:  # the first bytes, then blocked: the server holds the rest
                stream.readinto(buf)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(1)
    assert t.is_alive(), "the reader should be blocked in recv"
    stream.abort()
    t.join(10)
    assert not t.is_alive(), "abort() did not wake the reader"
    assert isinstance(box.get("error"), TransientError)
