"""Peer transfer in the agent: the peer server, who may read from it, and where the peers are.

- **Endpoint**: a TLS server (``--peer-port``) with this agent's certificate (``--peer-tls-cert``
  / ``--peer-tls-key``, else a fresh self-signed one per start). Its address, the certificate's
  SHA-256 and this node's ``topology.kubernetes.io/zone`` go into ``status.peer`` of the
  LocalModelNode: other agents pin that certificate.
- **Credential**: a ServiceAccount token for the ``modelcache-peer`` audience (deploy/ projects
  one into the pod; ``--peer-token-file``), sent with every request. The server checks each new
  token with a TokenReview for that audience and accepts only the identity of its own token
  (the agents' ServiceAccount); verdicts are cached for a minute.
- **Directory**: the LocalModelNodes of our node groups, watched (one watch per group, by the
  ``nodegroup.modelcache.io/<group>`` label the coordinator writes with the entries; every
  LocalModelNode only while an entry of ours names no group); a peer for a model is a node whose
  spec or status has the same storage key, with a ``status.peer`` endpoint, not in error for it.
  So a node's status write reaches the members of its groups, not every agent of the cluster, and
  each agent keeps its groups' objects, not the cluster's (bench/peer_directory.py measures both).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import ssl
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.config import AgentConfig
from agent.logs import fields
from agent.metrics import AgentMetrics
from modelcache.kube.client import LOCAL_MODEL_NODES, NODES, Kube
from modelcache.kube.informer import Informer
from modelcache.kube.objects import meta
from modelcache.kube.types import MODEL_DOWNLOAD_ERROR, MODEL_DOWNLOADED, node_group_label
from modelcache.kube.views import LocalModelNodeView
from modelcache.peers.client import PeerClient, PeerInfo, TokenFile
from modelcache.peers.network import PeerNetwork
from modelcache.peers.server import (
    FORBIDDEN,
    OK,
    THROTTLED,
    UNAUTHENTICATED,
    PeerServer,
    cert_fingerprint,
    server_context,
)
from modelcache.peers.swarm import SwarmSettings
from modelcache.runtime.clock import rfc3339
from modelcache.runtime.startup import StartupError
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore

log = logging.getLogger("agent.peers")

AUDIENCE = "modelcache-peer"
ZONE_LABEL = "topology.kubernetes.io/zone"
#: Seconds a TokenReview verdict is reused (accepted / refused), and how many are kept (LRU).
REVIEW_TTL, REFUSED_TTL, REVIEW_CACHE = 60.0, 10.0, 4096
#: Excluded peers published in our status at most (the newest; the CRD allows 64).
MAX_PUBLISHED = 32
#: TokenReviews per second at most (a burst of twice that), and at once: junk tokens from the pod
#: network must not become API-server writes charged to the agents (answered 503: ask again).
REVIEW_RATE, REVIEWS_AT_ONCE = 10.0, 4


def plausible(token: str, now: float | None = None) -> bool:
    """Whether ``token`` can be a ServiceAccount token for the peer audience at all: a JWT whose
    (unverified) claims name our audience and have not expired. Anything else is refused without
    a TokenReview; the review still decides for what passes (this checks no signature)."""
    parts = token.split(".")
    if len(parts) != 3 or not all(parts) or len(token) > 16384:
        return False
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, TypeError):
        return False
    if not isinstance(claims, dict):
        return False
    aud = claims.get("aud")
    audiences = aud if isinstance(aud, list) else [aud]
    exp = claims.get("exp")
    return AUDIENCE in audiences and isinstance(exp, int | float) and exp > (time.time() if now is None else now)


class TokenReviewer:
    """``authorize(token)``: a TokenReview for the peer audience, the same identity as ours.

    Verdicts are cached (LRU: a hit is the newest; refusals for 10 s), reviews are limited to
    ``REVIEW_RATE`` a second and ``REVIEWS_AT_ONCE`` in flight, and a token that cannot be one of
    ours (not a JWT of our audience, or expired) costs no review (docs/peers.md,
    "Authentication")."""

    def __init__(self, kube: Kube, rate: float = REVIEW_RATE, at_once: int = REVIEWS_AT_ONCE) -> None:
        from kubernetes import client

        self._api = client.AuthenticationV1Api(kube.api_client)
        self.allowed = ""
        self._cache: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()
        self._warned = False
        self.rate = rate
        self._tokens, self._stamp = 2 * rate, time.monotonic()
        self._in_flight = threading.BoundedSemaphore(max(1, at_once))
        self.reviews = 0

    def review(self, token: str) -> tuple[bool, str]:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [AUDIENCE]}}
        # A plain dict body and the raw response (no model objects): the client's types cover neither.
        create: Any = self._api.create_token_review
        resp = create(body, _preload_content=False)
        status = json.loads(resp.data).get("status") or {}
        user = (status.get("user") or {}).get("username", "")
        # An empty status.audiences means "the API server's own audience" (the TokenReview API),
        # never ours: only an explicit match counts.
        return bool(status.get("authenticated")) and AUDIENCE in (status.get("audiences") or []), user

    def learn_identity(self, own_token: str) -> str:
        """Reviews our own token: its identity is the one peers must have (the agents' SA)."""
        ok, user = self.review(own_token)
        if not ok or not user:
            raise StartupError(f"--peer-token-file: the API server does not accept our peer token for audience "
                               f"{AUDIENCE!r}; project a ServiceAccount token with that audience (deploy/agent)")
        self.allowed = user
        return user

    def _take(self) -> bool:
        """One review from the rate (a token bucket of ``2 * rate``)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(2 * self.rate, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True

    def authorize(self, token: str) -> str:
        digest = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None and hit[1] > now:
                self._cache.move_to_end(digest)
                return hit[0]
        if not plausible(token):
            return self._remember(digest, UNAUTHENTICATED)
        if not self._take() or not self._in_flight.acquire(blocking=False):
            return THROTTLED
        try:
            self.reviews += 1
            ok, user = self.review(token)
        except Exception as exc:  # the API server is away: refuse, and ask again soon
            if not self._warned:
                self._warned = True
                log.warning("cannot review a peer's token; refusing it", extra=fields(error=f"{type(exc).__name__}"))
            return THROTTLED
        finally:
            self._in_flight.release()
        return self._remember(digest, OK if ok and user == self.allowed else (FORBIDDEN if ok else UNAUTHENTICATED))

    def _remember(self, digest: str, verdict: str) -> str:
        with self._lock:
            self._cache[digest] = (verdict, time.monotonic() + (REVIEW_TTL if verdict == OK else REFUSED_TTL))
            self._cache.move_to_end(digest)
            while len(self._cache) > REVIEW_CACHE:
                self._cache.popitem(last=False)
        return verdict


def _split_endpoint(value: str) -> tuple[str, int] | None:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


#: What the directory reads of each model's details (not progress: it changes every status write).
DETAIL_FIELDS = ("storageKey", "state", "listingDigest")


def directory_essentials(lmn: dict[str, Any]) -> dict[str, Any]:
    """A LocalModelNode as the directory keeps it (every agent holds every node's): its name, the
    storage keys its entries want (``spec.storageKeys``), ``status.peer`` and, per model, only
    ``DETAIL_FIELDS``."""
    view = LocalModelNodeView(lmn)
    m = view.meta
    keys = sorted({storage_key(e.source_model_uri) for e in view.entries if e.source_model_uri})
    details = {name: {k: d[k] for k in DETAIL_FIELDS if k in d}
               for name, d in view.model_details.items() if isinstance(d, dict)}
    kept: dict[str, Any] = {"modelDetails": details}
    if isinstance(view.status.get("peer"), dict):
        kept["peer"] = view.status["peer"]
    return {"apiVersion": lmn.get("apiVersion"), "kind": lmn.get("kind"),
            "metadata": {k: v for k, v in (("name", m.name), ("uid", m.uid), ("resourceVersion", m.resource_version))
                         if v},
            "spec": {"storageKeys": keys}, "status": kept}


class Directory:
    """Who holds or fetches a model, from the LocalModelNodes of our node groups (one informer per
    group, lean objects), or from every LocalModelNode while our groups are not known by name."""

    def __init__(self, kube: Kube, me: str, sync_wait: float = 5.0) -> None:
        self.kube, self.me = kube, me
        #: Every LocalModelNode: used while ``groups`` is None (started by ``scope``).
        self.informer = Informer(kube, LOCAL_MODEL_NODES, transform=directory_essentials)
        #: Our node groups (``scope``); None: not known by name, every LocalModelNode is watched.
        self.groups: frozenset[str] | None = None
        self.scoped: dict[str, Informer] = {}
        #: Seconds ``peers`` waits for a group's first list (a download starts as its entry arrives,
        #: with the group's watch: without the wait it would see no peer and read the origin).
        self.sync_wait = sync_wait
        self._lock = threading.Lock()
        self._stopped = False
        #: Nodes we excluded ourselves (set by Peering: the network's list).
        self.excluded: Callable[[str], bool] = lambda node: False

    def scope(self, groups: frozenset[str] | None) -> None:
        """Watch the LocalModelNodes of ``groups`` (our entries' node groups), and no other."""
        stop: list[Informer] = []
        with self._lock:
            if self._stopped:
                return
            if groups is None:
                if not self.informer.started:
                    self.informer.start()
                stop, self.scoped = list(self.scoped.values()), {}
            else:
                if self.informer.started:
                    stop.append(self.informer)
                    self.informer = Informer(self.kube, LOCAL_MODEL_NODES, transform=directory_essentials)
                for group in set(self.scoped) - groups:
                    stop.append(self.scoped.pop(group))
                for group in sorted(groups - set(self.scoped)):
                    self.scoped[group] = Informer(self.kube, LOCAL_MODEL_NODES,
                                                  label_selector=f"{node_group_label(group)}=true",
                                                  transform=directory_essentials).start()
            if groups != self.groups:
                log.info("peer directory", extra=fields(groups=",".join(sorted(groups)) if groups is not None
                                                        else "(all LocalModelNodes)"))
            self.groups = groups
        for informer in stop:
            informer.stop(timeout=0)  # not joined: called from the agent's own watch

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            informers = [self.informer, *self.scoped.values()]
        for informer in informers:
            if informer.started:
                informer.stop()

    def objects(self) -> list[dict[str, Any]]:
        """The LocalModelNodes we know (each once: a node in two of our groups is in both watches)."""
        with self._lock:
            informers = list(self.scoped.values()) if self.groups is not None else [self.informer]
        seen: dict[str, dict[str, Any]] = {}
        for informer in informers:
            if informer.started:
                informer.wait_for_sync(self.sync_wait)
            for obj in informer.store.list(copy_objects=False):
                seen.setdefault(meta(obj).name, obj)
        return list(seen.values())

    def vetoed(self, mine: Callable[[str], bool] = lambda node: False) -> set[str]:
        """Nodes another node excluded (its ``status.peer.excluded``: its word, which only it may
        write): skipped by us too. The word of a node we excluded ourselves does not count. A
        node can so make others skip a peer, which costs origin bytes, never a wrong one."""
        out: set[str] = set()
        for obj in self.objects():
            name = meta(obj).name
            if name == self.me or mine(name):
                continue
            for item in LocalModelNodeView(obj).peer.get("excluded") or []:
                if isinstance(item, dict) and isinstance(item.get("node"), str) and item["node"] != self.me:
                    out.add(item["node"])
        return out

    def peers(self, key: str) -> list[PeerInfo]:
        out = []
        vetoed = self.vetoed(self.excluded)
        for obj in self.objects():
            view = LocalModelNodeView(obj)
            name, peer = view.meta.name, view.peer
            where = _split_endpoint(str(peer.get("endpoint") or ""))
            fingerprint = str(peer.get("certSHA256") or "")
            if name == self.me or where is None or len(fingerprint) != 64 or name in vetoed:
                continue
            details = [d for d in view.model_details.values() if isinstance(d, dict) and d.get("storageKey") == key]
            wanted = key in view.storage_keys
            if not details and not wanted:
                continue
            state = details[0].get("state") if details else ""
            if state == MODEL_DOWNLOAD_ERROR:
                continue
            digest = details[0].get("listingDigest") if details else None
            out.append(PeerInfo(name, where[0], where[1], fingerprint, str(peer.get("zone") or ""),
                                str(digest) if digest else None, state == MODEL_DOWNLOADED and bool(digest)))
        return out


def peer_tls(cert: Path | str | None, key: Path | str | None, node: str) -> tuple[ssl.SSLContext, str]:
    """The peer server's TLS context and its certificate's SHA-256 (published for pinning):
    ``--peer-tls-cert``/``--peer-tls-key``, else a self-signed pair for ``node``. The generated
    pair is on disk only while OpenSSL loads it (``load_cert_chain`` reads files, not bytes): its
    private key is not left behind in the temp dir (stop 39 found 237 such folders there, each
    with a key, from agents that had stopped)."""
    if cert and key:
        return server_context(str(cert), str(key)), cert_fingerprint(Path(cert).read_text())
    from coordinator.certs import generate_self_signed  # one helper for both self-signed pairs

    with tempfile.TemporaryDirectory(prefix="modelcache-peer-tls-") as folder:
        made_cert, made_key = generate_self_signed(Path(folder), [node])
        return server_context(str(made_cert), str(made_key)), cert_fingerprint(made_cert.read_text())


class Peering:
    """Built by ``start_peering``; the agent asks it for ``network`` (its downloads) and status."""

    def __init__(self, cfg: AgentConfig, kube: Kube, store: NodeStore, metrics: AgentMetrics,
                 on_change: Any, on_event: Callable[[str, str, str], None] | None = None) -> None:
        self.cfg, self.kube, self.metrics = cfg, kube, metrics
        self.on_event = on_event
        self.zone = self._zone()
        self.token = TokenFile(cfg.peer_token_file)
        self.reviewer = TokenReviewer(kube)
        context, self.fingerprint = peer_tls(cfg.peer_tls_cert, cfg.peer_tls_key, cfg.node)
        self.directory = Directory(kube, cfg.node)
        settings = SwarmSettings(node=cfg.node, zone=self.zone, wait=cfg.peer_wait, formation=cfg.peer_formation,
                                 witnesses=cfg.peer_witnesses)
        self.network = PeerNetwork(settings, self.directory.peers, PeerClient(self.token, cfg.workers), store,
                                   on_change, self._excluded)
        self.directory.excluded = self.network.excluded
        self.metrics.peers_excluded.set_function(lambda: len(self.network.exclusions.items()))
        self.server = PeerServer(cfg.peer_host, cfg.peer_port, context, self.network,
                                 self.reviewer.authorize, cfg.peer_max_uploads, cfg.peer_upload_rate,
                                 on_upload=self._uploaded, on_reject=self._rejected,
                                 on_poll=self.metrics.peer_polls.inc)
        self.endpoint = self._endpoint()

    def _zone(self) -> str:
        try:
            node = self.kube.get_or_none(NODES, self.cfg.node) or {}
        except Exception:
            return ""
        return str(meta(node).labels.get(ZONE_LABEL, ""))

    def _endpoint(self) -> str:
        """``--peer-address`` (HOST, HOST:PORT or [V6]:PORT), else the pod IP; the port defaults
        to the one served on."""
        value = self.cfg.peer_address or os.environ.get("POD_IP", "")
        if not value:
            raise StartupError("--peer-address: no address to publish for peers (set POD_IP from status.podIP, "
                               "or --peer-address HOST[:PORT])")
        where = _split_endpoint(value) if value.startswith("[") or value.count(":") == 1 else None
        host, port = where if where is not None else (value.strip("[]"), self.server.port)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _excluded(self, node: str, why: str) -> None:
        """A peer found lying: counted, an Event on our LocalModelNode, and (status) published."""
        self.metrics.peer_dropped.inc()
        log.warning("peer excluded", extra=fields(peer=node, reason=why))
        if self.on_event is not None:
            try:
                self.on_event("Warning", "PeerExcluded", f"peer {node} excluded for a day: {why}")
            except Exception as exc:
                log.warning("could not report an event", extra=fields(error=f"{type(exc).__name__}"))

    def _uploaded(self, n: int) -> None:
        self.metrics.peer_uploaded.inc(n)

    def _rejected(self, reason: str) -> None:
        self.metrics.peer_rejected.labels(reason=reason).inc()

    def start(self) -> Peering:
        identity = self.reviewer.learn_identity(self.token())  # the directory starts with our groups (scope)
        self.server.start()
        log.info("peer transfer on", extra=fields(endpoint=self.endpoint, zone=self.zone, identity=identity,
                                                  max_uploads=self.cfg.peer_max_uploads,
                                                  upload_rate=self.server.bucket.rate))
        return self

    def stop(self) -> None:
        self.server.stop()
        self.directory.stop()
        self.network.client.close()

    # ---- status ------------------------------------------------------------------------------

    def model_fields(self, key: str) -> dict[str, Any]:
        stats = self.network.stats(key)
        if stats is None:
            return {}
        return {"listingDigest": stats.listing_digest, "bytesFromOrigin": stats.from_origin,
                "bytesFromPeers": stats.from_peers}

    def status(self, keys: list[str]) -> dict[str, Any]:
        origin = peers = 0
        for key in keys:
            stats = self.network.stats(key)
            if stats is not None:
                origin, peers = origin + stats.from_origin, peers + stats.from_peers
        excluded = [{"node": e.node, "reason": e.reason, "since": rfc3339(e.since)}
                    for e in self.network.exclusions.items()[-MAX_PUBLISHED:]]
        return {"endpoint": self.endpoint, "certSHA256": self.fingerprint, **({"zone": self.zone} if self.zone else {}),
                "bytesFromOrigin": origin, "bytesFromPeers": peers, **({"excluded": excluded} if excluded else {})}


def start_peering(cfg: AgentConfig, kube: Kube, store: NodeStore, metrics: AgentMetrics,
                  on_change: Any, before_start: Any = None,
                  on_event: Callable[[str, str, str], None] | None = None) -> Peering | None:
    """Peer transfer per ``--peers``: ``off``; ``on`` (a missing token is a startup error);
    ``auto`` (default: on when the token file exists)."""
    if cfg.peers == "off":
        log.info("peer transfer off (--peers=off)")
        return None
    if not cfg.peer_token_file.exists():
        if cfg.peers == "on":
            raise StartupError(f"--peer-token-file: {cfg.peer_token_file} does not exist; project a ServiceAccount "
                               f"token with audience {AUDIENCE!r} there (deploy/agent), or set --peers=off")
        log.info("peer transfer off: no peer token", extra=fields(peer_token_file=str(cfg.peer_token_file)))
        return None
    peering = Peering(cfg, kube, store, metrics, on_change, on_event)  # the port is bound: a taken one is named first
    if before_start is not None:
        before_start()  # e.g. the agent's check that the API server answers: start() asks it
    return peering.start()
