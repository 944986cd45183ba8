"""The coordinator's webhook server (HTTPS; health and metrics are modelcache.runtime.health's).

Threaded stdlib servers: admission requests are short and independent, and the API reads they
make are blocking client calls anyway.

Anyone who reaches the port can connect, so what a connection may cost is bounded: the TLS
handshake and every read must finish within ``TIMEOUT`` (a connection that never starts TLS, or
stops sending, is closed), at most ``MAX_CONNECTIONS`` are served at once (more are closed at
accept), a body is at most ``MAX_BODY`` and only ``MAX_LARGE`` bodies over ``LARGE`` are parsed at
a time (a JSON body of empty lists costs ~25 times its size in Python objects). With
``client_names`` (``--webhook-client-ca``), the TLS context requires a client certificate and a
request is served only for one of those names: the API server's, configured as Kubernetes
documents it (kube-apiserver's ``--admission-control-config-file``, docs/operations.md).
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any

from coordinator import metrics
from modelcache.runtime.listen import http_server

log = logging.getLogger(__name__)

AdmissionHandler = Callable[[dict[str, Any]], dict[str, Any]]
#: A path -> its handler, or None (404).
Routes = Callable[[str], AdmissionHandler | None]
#: The API server sends at most an object and its old version of 1.5 MiB each (etcd's default
#: request limit) in one AdmissionReview; pods and caches are a few KiB.
MAX_BODY = 4 << 20
LARGE, MAX_LARGE = 256 << 10, 2
#: Seconds for the TLS handshake and for each read (the request line, headers, the body, and the
#: wait for the next request on a kept-alive connection). The API server gives a webhook at most 30.
TIMEOUT = 10.0
#: Connections served at once. The API server keeps a few per replica; 300 idle connections held
#: 300 threads before the limit (docs/operations.md, "Threat model").
MAX_CONNECTIONS = 128


def peer_names(cert: Mapping[str, Any] | None) -> set[str]:
    """The common name and DNS names of a verified peer certificate (``SSLSocket.getpeercert()``)."""
    if not cert:
        return set()
    names = {value for rdn in cert.get("subject") or () for key, value in rdn if key == "commonName"}
    names |= {value for kind, value in cert.get("subjectAltName") or () if kind == "DNS"}
    return names


class WebhookServer:
    """POST ``path`` with an AdmissionReview -> the handler's AdmissionReview."""

    def __init__(self, host: str, port: int, routes: Mapping[str, AdmissionHandler] | Routes,
                 context: ssl.SSLContext | None, client_names: tuple[str, ...] = (),
                 max_connections: int = MAX_CONNECTIONS, timeout: float = TIMEOUT) -> None:
        resolve: Routes = routes.get if isinstance(routes, Mapping) else routes
        handler = self._handler_class(resolve, set(client_names), timeout)
        self.httpd = http_server(host, port, handler, max_connections=max_connections)
        self.httpd.handle_error = self._handle_error  # type: ignore[method-assign]
        if context is not None:
            # Handshake in the request thread, not in accept(): a slow client must not stall the others
            # (and it is bounded by the handler's timeout there).
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True,
                                                    do_handshake_on_connect=False)
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @staticmethod
    def _handle_error(request: Any, client_address: Any) -> None:
        """A failed handshake (no or an untrusted client certificate, plain HTTP, a timeout) or a
        dropped connection: one line, not the socketserver's traceback."""
        import sys

        exc = sys.exc_info()[1]
        log.info("webhook: connection from %s ended: %s: %s", client_address[0] if client_address else "?",
                 type(exc).__name__, exc)

    @staticmethod
    def _handler_class(routes: Routes, client_names: set[str], read_timeout: float) -> type[BaseHTTPRequestHandler]:
        large = threading.BoundedSemaphore(MAX_LARGE)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = read_timeout  # StreamRequestHandler puts it on the socket: the handshake and every read

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("webhook: " + fmt, *args)

            def do_POST(self) -> None:
                path = self.path.split("?", 1)[0]
                if client_names and not client_names & peer_names(self.connection.getpeercert()):
                    log.warning("webhook: POST %s from %s refused: its client certificate names none of %s", path,
                                self.client_address[0], ", ".join(sorted(client_names)))
                    self._send(403, {"error": "client certificate not allowed"})
                    return
                handle = routes(path)
                length = int(self.headers.get("Content-Length") or 0)
                if handle is None:
                    if path.startswith("/uninstall"):
                        log.warning("webhook: POST %s from %s ignored: not the uninstall webhook's path",
                                    path.split("/")[1], self.client_address[0])
                    self._send(404, {"error": "not found"})
                    return
                if length <= 0 or length > MAX_BODY:
                    self._send(413 if length > MAX_BODY else 400, {"error": "bad request"})
                    return
                big = length > LARGE
                if big and not large.acquire(timeout=read_timeout):
                    self._send(503, {"error": "busy"})
                    return
                try:
                    self._serve(path, handle, length)
                finally:
                    if big:
                        large.release()

            def _serve(self, path: str, handle: AdmissionHandler, length: int) -> None:
                path = "/uninstall" if path.startswith("/uninstall/") else path  # its secret in no log or metric
                try:
                    review = json.loads(self.rfile.read(length))
                except ValueError:
                    self._send(400, {"error": "not JSON"})
                    return
                if not isinstance(review, dict) or not isinstance(review.get("request"), dict):
                    self._send(400, {"error": "not an AdmissionReview"})
                    return
                try:
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
                if code >= 400:
                    self.send_header("Connection", "close")  # the rest of what it sent is not read
                    self.close_connection = True
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
