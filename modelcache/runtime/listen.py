"""Listening sockets for our small HTTP servers: one address that means "every address, IPv4 and
IPv6", so health probes and webhook calls reach us on IPv4, IPv6 and dual-stack clusters alike."""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

#: Bind addresses that mean every address of both families.
ANY = ("", "::", "[::]")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    #: None: no limit; else connections served at once (more are closed at accept).
    slots: threading.BoundedSemaphore | None = None
    max_connections = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if self.slots is not None and not self.slots.acquire(blocking=False):
            log.warning("%d connections open already: closing a new one from %s", self.max_connections,
                        client_address[0] if client_address else "?")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            if self.slots is not None:
                self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            if self.slots is not None:
                self.slots.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


class _DualStack(_Server6):
    def server_bind(self) -> None:
        # One IPv6 socket that also accepts IPv4 (as ::ffff:a.b.c.d), whatever net.ipv6.bindv6only says.
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def http_server(host: str, port: int, handler: type[BaseHTTPRequestHandler],
                max_connections: int | None = None) -> ThreadingHTTPServer:
    """A threaded HTTP server on ``host``: ``::`` (or ``""``) is every address of both families,
    falling back to every IPv4 address where the kernel has IPv6 off; an IPv6 literal binds that
    address; anything else is IPv4 (or a name resolved as such). ``max_connections``: at most
    that many served at once (a thread each); more are closed as they are accepted."""
    server = _bind(host, port, handler)
    if max_connections is not None:
        server.slots, server.max_connections = threading.BoundedSemaphore(max_connections), max_connections
    return server


def _bind(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> _Server:
    if host in ANY:
        if socket.has_ipv6:
            try:
                return _DualStack(("::", port), handler)
            except OSError as exc:  # IPv6 disabled on this machine
                log.info("IPv6 is not available (%s): listening on IPv4 only", exc)
        return _Server(("0.0.0.0", port), handler)
    if ":" in host:
        return _Server6((host.strip("[]"), port), handler)
    return _Server((host, port), handler)
