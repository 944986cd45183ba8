"""The one health and metrics server of our long-running processes (the agent and the
coordinator): ``/healthz``, ``/readyz`` and ``/metrics`` on a small threaded HTTP server that
listens on IPv4 and IPv6 (modelcache.runtime.listen)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from modelcache.runtime.listen import http_server

log = logging.getLogger(__name__)


class HealthServer:
    """``healthy()``: the process works (its loops are alive); ``ready()``: it may be sent work
    (spec synced, leader or not); ``metrics()``: the Prometheus text of its registry."""

    def __init__(self, host: str, port: int, healthy: Callable[[], bool], ready: Callable[[], bool],
                 metrics: Callable[[], bytes], name: str = "health") -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                # Probes come every few seconds: a debug line at most.
                log.debug(f"{name}: {fmt}", *args)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, outer.metrics(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    ok = outer.healthy()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n")
                elif path == "/readyz":
                    ok = outer.ready()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"not ready\n")
                else:
                    self._send(404, b"not found\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.healthy, self.ready, self.metrics = healthy, ready, metrics
        self.server = http_server(host, port, Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name=f"{name}-http", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
