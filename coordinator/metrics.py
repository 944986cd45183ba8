"""Prometheus metrics of the coordinator (one registry, served on ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

REGISTRY = CollectorRegistry()

RECONCILES = Counter("modelcache_coordinator_reconciles_total", "Reconciles by controller and outcome",
                     ["controller", "outcome"], registry=REGISTRY)
WRITES = Counter("modelcache_coordinator_api_writes_total", "API writes by kind and verb", ["kind", "verb"],
                 registry=REGISTRY)
COPIES = Gauge("modelcache_cache_copies", "Copies of a cached model by state (available, total, failed)",
               ["cache", "state"], registry=REGISTRY)
WEBHOOK = Counter("modelcache_coordinator_webhook_requests_total", "Admission requests by path and result",
                  ["path", "result"], registry=REGISTRY)
API_REQUESTS = Counter("modelcache_coordinator_api_requests_total",
                       "Requests to the API server by HTTP verb (WATCH: a watch opened)", ["verb"], registry=REGISTRY)
WEBHOOK_CERT_EXPIRY = Gauge("modelcache_coordinator_webhook_cert_expiry_timestamp_seconds",
                            "notAfter of the webhook serving certificate this replica serves", registry=REGISTRY)
LEADER = Gauge("modelcache_coordinator_leader", "1 while this replica holds the lease", registry=REGISTRY)


def render() -> bytes:
    return generate_latest(REGISTRY)


def wrote(kind: str, verb: str, result: object = True) -> object:
    """Count one API write when ``result`` says one happened (update helpers return None if not)."""
    if result is not None:
        WRITES.labels(kind, verb).inc()
    return result
