"""Health, metrics and webhook servers listen on IPv4 and IPv6 by default (dual-stack and IPv6
single-stack clusters probe pods and call webhooks over IPv6)."""

from __future__ import annotations

import socket
import urllib.request

from agent.config import AgentConfig
from agent.health import HealthServer as AgentHealth
from coordinator.app import Config
from coordinator.httpserve import HealthServer
from modelcache.listen import http_server
from tests.helpers import free_port, require


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return int(resp.status)


def ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_default_binds_answer_on_ipv4_and_ipv6() -> None:
    require(ipv6(), "an IPv6 loopback address (::1)")
    assert AgentConfig(node="n").host == Config().host == Config().webhook_host == "::"
    agent = AgentHealth(AgentConfig(node="n").host, 0, lambda: True, lambda: True, lambda: b"").start()
    coordinator = HealthServer(Config().host, free_port(), lambda: True).start()
    try:
        for port in (agent.port, coordinator.port):
            assert get(f"http://127.0.0.1:{port}/healthz") == 200
            assert get(f"http://[::1]:{port}/healthz") == 200
    finally:
        agent.stop()
        coordinator.stop()


def test_an_ipv4_address_binds_ipv4_only() -> None:
    from http.server import BaseHTTPRequestHandler

    server = http_server("127.0.0.1", 0, BaseHTTPRequestHandler)
    try:
        assert server.socket.family == socket.AF_INET
    finally:
        server.server_close()
