"""A small static file server with Range, ETag and Repr-Digest, for the demo and manual checks.

Not for production and not used by the tests (they run real nginx). It exists so `make demo`
needs nothing but the project itself: ``python -m examples.devserver DIR --port 8000``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import threading
from functools import partial
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_digests: dict[tuple[str, int, int], str] = {}
_digest_lock = threading.Lock()


def repr_digest(path: str) -> str:
    """RFC 9530 ``Repr-Digest`` of a file, cached by (path, size, mtime)."""
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    with _digest_lock:
        if key in _digests:
            return _digests[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    value = f"sha-256=:{base64.b64encode(h.digest()).decode()}:"
    with _digest_lock:
        _digests[key] = value
    return value


class RangeHandler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path = self.translate_path(self.path.split("?", 1)[0])
        if not os.path.isfile(path):
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        size = os.path.getsize(path)
        st = os.stat(path)
        etag = f'"{st.st_mtime_ns:x}-{size:x}"'
        start, end = 0, size - 1
        status = HTTPStatus.OK
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                self.send_error(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                return
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:
                start = max(0, size - int(m.group(2)))
            if start >= size or start > end:
                self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = HTTPStatus.PARTIAL_CONTENT
        if_match = self.headers.get("If-Match")
        if if_match and if_match != etag:
            self.send_error(HTTPStatus.PRECONDITION_FAILED)
            return
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("Repr-Digest", repr_digest(path))
        self.send_header("Content-Length", str(end - start + 1 if size else 0))
        if status == HTTPStatus.PARTIAL_CONTENT:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if body and size:
            with open(path, "rb") as f:
                offset, remaining = start, end - start + 1
                while remaining > 0:
                    sent = os.sendfile(self.connection.fileno(), f.fileno(), offset, min(remaining, 8 << 20))
                    if sent == 0:
                        break
                    offset += sent
                    remaining -= sent


def serve(directory: Path, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """Start serving ``directory`` in a background thread; ``server.server_address`` has the port."""
    handler = partial(RangeHandler, directory=str(directory))
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="modelcache-devserver", daemon=True).start()
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    server = serve(args.directory, args.host, args.port)
    print(f"serving {args.directory} on http://{args.host}:{server.server_address[1]}/")
    threading.Event().wait()


if __name__ == "__main__":
    main()
