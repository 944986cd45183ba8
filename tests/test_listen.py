"""Health, metrics and webhook servers listen on IPv4 and IPv6 by default (dual-stack and IPv6
single-stack clusters probe pods and call webhooks over IPv6)."""

from __future__ import annotations

import socket
import urllib.request

from agent.config import AgentConfig
from coordinator.app import Config
from modelcache.runtime.health import HealthServer
from modelcache.runtime.listen import http_server
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
    server = HealthServer(Config().host, free_port(), lambda: True, lambda: True, lambda: b"").start()
    try:
        assert get(f"http://127.0.0.1:{server.port}/healthz") == 200
        assert get(f"http://[::1]:{server.port}/healthz") == 200
    finally:
        server.stop()


def test_an_ipv4_address_binds_ipv4_only() -> None:
    from http.server import BaseHTTPRequestHandler

    server = http_server("127.0.0.1", 0, BaseHTTPRequestHandler)
    try:
        assert server.socket.family == socket.AF_INET
    finally:
        server.server_close()


def test_health_server_answers_from_its_callables() -> None:
    """The one health server (agent and coordinator): 503 while unhealthy or not ready, the
    registry's text on /metrics, 404 elsewhere."""
    import urllib.error

    state = {"healthy": False, "ready": False}
    server = HealthServer("127.0.0.1", 0, lambda: state["healthy"], lambda: state["ready"],
                          lambda: b"modelcache_up 1\n").start()
    base = f"http://127.0.0.1:{server.port}"

    def code(path: str) -> int:
        try:
            return get(base + path)
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert (code("/healthz"), code("/readyz"), code("/nothing")) == (503, 503, 404)
        state.update(healthy=True, ready=True)
        assert (code("/healthz"), code("/readyz?verbose")) == (200, 200)
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            assert resp.read() == b"modelcache_up 1\n"
            assert resp.headers["Content-Type"].startswith("text/plain")
    finally:
        server.stop()
