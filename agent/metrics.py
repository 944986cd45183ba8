"""Prometheus metrics of one agent (own registry, so tests can run several agents in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from modelcache.kube.types import MODEL_STATES

DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, float("inf"))


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes = Counter("modelcache_agent_downloaded_bytes", "Bytes downloaded, by source scheme",
                             ["scheme"], registry=r)
        self.duration = Histogram("modelcache_agent_download_duration_seconds",
                                  "Duration of finished downloads (attempts that ended)", ["scheme", "outcome"],
                                  buckets=DURATION_BUCKETS, registry=r)
        self.models = Gauge("modelcache_agent_models", "Models in the spec, by state", ["state"], registry=r)
        self.errors = Counter("modelcache_agent_errors", "Failed download attempts and checks, by reason",
                              ["reason"], registry=r)
        self.free = Gauge("modelcache_agent_free_bytes", "Free bytes on the model root's file system", registry=r)
        # Size, stored bytes and the node group's limit: what the "root near full" and "over the
        # group's storageLimit" alerts compare (monitoring/alerts.yaml).
        self.size = Gauge("modelcache_agent_root_size_bytes", "Size of the model root's file system", registry=r)
        self.stored = Gauge("modelcache_agent_stored_bytes", "Bytes of the models published on this node (what "
                            "counts against a node group's storageLimit)", registry=r)
        self.limit = Gauge("modelcache_agent_storage_limit_bytes", "storageLimit of each node group this node's "
                           "models belong to", ["node_group"], registry=r)
        self.drifted = Gauge("modelcache_agent_drifted_models", "Models whose source changed since they were "
                             "downloaded (a drift check; the copy is left as it is)", registry=r)
        self.status_published = Gauge("modelcache_agent_status_published_timestamp_seconds",
                                      "When the agent last wrote (or confirmed) its status report", registry=r)
        self.reserved = Gauge("modelcache_agent_reserved_bytes", "Bytes reserved by downloads in flight", registry=r)
        self.removals_waiting = Gauge("modelcache_agent_removals_waiting",
                                      "Models out of the spec kept because a running pod mounts them", registry=r)
        self.model_bytes = Counter("modelcache_agent_model_bytes", "Bytes of each model's downloads by where they "
                                   "came from (origin, peer), counted when a download ends",
                                   ["storage_key", "source"], registry=r)
        self.peer_uploaded = Counter("modelcache_agent_peer_uploaded_bytes", "Bytes served to other agents",
                                     registry=r)
        # A poll's CPU (the request, the reply's JSON, TLS on both ends) grows with the peers that
        # poll, not with the bytes: bench/fleet.py reads it to give bench/swarm_sim.py its cost.
        self.peer_polls = Counter("modelcache_agent_peer_polls_answered", "Long polls of what this agent holds "
                                  "answered (200)", registry=r)
        self.peer_rejected = Counter("modelcache_agent_peer_rejected", "Peer requests refused, by reason "
                                     "(unauthenticated, forbidden, throttled, busy, tls, connections)", ["reason"],
                                     registry=r)
        self.peer_dropped = Counter("modelcache_agent_peer_dropped", "Peers excluded after a wrong piece, or a "
                                    "hash the origin contradicts (docs/peers.md)", registry=r)
        self.peers_excluded = Gauge("modelcache_agent_peers_excluded", "Peers excluded now (for a day each)",
                                    registry=r)
        self._limit_groups: set[str] = set()
        for state in MODEL_STATES:
            if state:
                self.models.labels(state=state)

    def set_states(self, counts: dict[str, int]) -> None:
        for state in MODEL_STATES:
            if state:
                self.models.labels(state=state).set(counts.get(state, 0))

    def download_started(self, scheme: str) -> None:
        """The series of a scheme's downloads exist, at 0, from its first attempt on: Prometheus'
        ``rate``/``increase`` need a sample before a counter moves, else the first failures (what
        ModelcacheDownloadsFailing counts) and the first finished download (the dashboard's download
        times) are invisible to them."""
        self.bytes.labels(scheme=scheme)
        for outcome in ("ok", "error"):
            self.duration.labels(scheme=scheme, outcome=outcome)

    def set_limits(self, limits: dict[str, int]) -> None:
        """The storageLimit of each node group this node serves now (a group that left: no series)."""
        for group in self._limit_groups - limits.keys():
            self.limit.remove(group)
        for group, limit in limits.items():
            self.limit.labels(node_group=group).set(limit)
        self._limit_groups = set(limits)

    def render(self) -> bytes:
        return generate_latest(self.registry)
