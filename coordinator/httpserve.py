"""The coordinator's webhook server (HTTPS; health and metrics are modelcache.health's).

Threaded stdlib servers: admission requests are short and independent, and the API reads they
make are blocking client calls anyway.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from coordinator import metrics
from modelcache.listen import http_server

log = logging.getLogger(__name__)

AdmissionHandler = Callable[[dict[str, Any]], dict[str, Any]]
MAX_BODY = 8 << 20


class WebhookServer:
    """POST ``path`` with an AdmissionReview -> the handler's AdmissionReview."""

    def __init__(self, host: str, port: int, routes: dict[str, AdmissionHandler],
                 context: ssl.SSLContext | None) -> None:
        handler = self._handler_class(routes)
        self.httpd = http_server(host, port, handler)
        if context is not None:
            # Handshake in the request thread, not in accept(): a slow client must not stall the others.
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True,
                                                    do_handshake_on_connect=False)
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @staticmethod
    def _handler_class(routes: dict[str, AdmissionHandler]) -> type[BaseHTTPRequestHandler]:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("webhook: " + fmt, *args)

            def do_POST(self) -> None:
                path = self.path.split("?", 1)[0]
                handle = routes.get(path)
                length = int(self.headers.get("Content-Length") or 0)
                if handle is None or length <= 0 or length > MAX_BODY:
                    self._send(404 if handle is None else 400, {"error": "bad request"})
                    return
                try:
                    review = json.loads(self.rfile.read(length))
                    out = handle(review)
                except Exception as exc:
                    log.exception("webhook %s failed", path)
                    metrics.WEBHOOK.labels(path, "error").inc()
                    self._send(500, {"error": type(exc).__name__})
                    return
                allowed = (out.get("response") or {}).get("allowed")
                metrics.WEBHOOK.labels(path, "allowed" if allowed else "denied").inc()
                self._send(200, out)

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def start(self) -> WebhookServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="webhooks", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

