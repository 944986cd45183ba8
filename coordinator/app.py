"""The running coordinator: health/metrics, webhooks and warm informers on every replica; the
reconcilers only on the replica holding the Lease (started when it is won; the process exits
when it is lost, as controller-runtime does, so a deposed leader never writes beside the new one)."""

from __future__ import annotations

import datetime as dt
import logging
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes.client.exceptions import ApiException

from coordinator import controllers, metrics
from coordinator.admission import CacheValidator, PodMutator, ServiceDefaulter
from coordinator.certs import CERT_FILE, ReloadingContext, generate_self_signed, load_tls
from coordinator.httpserve import AdmissionHandler, WebhookServer
from coordinator.lookup import ApiLookup
from coordinator.uninstall import UninstallHook
from coordinator.uninstallpath import PREFIX as UNINSTALL_PREFIX
from coordinator.uninstallpath import UninstallPath
from coordinator.view import ClusterView
from coordinator.webhookcerts import YEAR, CertSettings, WebhookCerts
from modelcache.kube.client import (
    CUSTOM_RESOURCE_DEFINITIONS,
    NAMESPACES,
    Kube,
    check_api_server,
    config_source,
    count_requests,
    load_api_client,
)
from modelcache.kube.controller import Manager
from modelcache.kube.events import EventRecorder
from modelcache.kube.informer import Informer
from modelcache.kube.leader import LeaderElector
from modelcache.kube.objects import meta
from modelcache.runtime.health import HealthServer
from modelcache.runtime.startup import StartupError, listen_error

log = logging.getLogger(__name__)

#: KServe's service CRDs, watched by name until both are served.
SERVICE_CRDS = ("inferenceservices.serving.kserve.io", "llminferenceservices.serving.kserve.io")


@dataclass
class Config:
    kubeconfig: str | None = None
    #: A directory with tls.crt/tls.key (cert-manager's Secret volume, or made by hand): served
    #: as it is and reloaded when it changes. With ``webhook_cert_secret`` the pair is written here.
    webhook_cert_dir: Path | None = None
    #: Self-provisioned certificate: the Secret (in ``lease_namespace``) holding our CA and serving
    #: pair, kept current with the webhook configurations' caBundle (coordinator/webhookcerts.py).
    webhook_cert_secret: str | None = None
    webhook_service: str = "modelcache-coordinator-webhook"
    #: More names/IPs in the serving certificate (webhooks reached by URL).
    webhook_cert_hosts: tuple[str, ...] = ()
    webhook_cert_validity: dt.timedelta = YEAR
    webhook_ca_validity: dt.timedelta = 10 * YEAR
    webhook_cert_check: float = 3600.0
    webhook_host: str = "::"
    webhook_port: int = 9443
    #: Mutual TLS: the CA of the API server's webhook client certificate; callers without one
    #: fail the handshake. With ``webhook_client_names``, only certificates for those names.
    webhook_client_ca: Path | None = None
    webhook_client_names: tuple[str, ...] = ()
    self_signed: bool = False
    host: str = "::"
    port: int = 8080
    leader_election: bool = True
    lease_name: str = "modelcache-coordinator"
    lease_namespace: str = "modelcache-system"
    identity: str = field(default_factory=socket.gethostname)
    mutate_isvc: bool = False
    pod_rewrite: bool = False
    pod_fail_closed: bool = False
    workers: int = 2
    watch_timeout: int = 300
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    #: Seconds between checks for InferenceService/LLMInferenceService CRDs installed after start (0: off).
    discovery_interval: float = 30.0
    #: Seconds a vanished node group's members keep their entries (None: until it returns, as KServe).
    missing_group_grace: float | None = None
    #: Seconds a deleted Node keeps its LocalModelNode, in case it registers again (coordinator.grace).
    deleted_node_grace: float = 15.0


class Coordinator:
    def __init__(self, cfg: Config, kube: Kube | None = None) -> None:
        self.cfg = cfg
        #: Where the cluster was found, checked once at start (None: a client handed in, e.g. by tests).
        self._source = config_source(cfg.kubeconfig) if kube is None else None
        self.kube = kube or Kube(load_api_client(cfg.kubeconfig))
        count_requests(self.kube.api_client, lambda verb: metrics.API_REQUESTS.labels(verb).inc())
        self.view: ClusterView | None = None
        self.manager: Manager | None = None
        self.wiring: controllers.Wiring | None = None
        self.webhooks: WebhookServer | None = None
        self.uninstall_path: UninstallPath | None = None
        self.tls: ReloadingContext | None = None
        self.certs: WebhookCerts | None = None
        #: The folder we made for the cert manager's pair (no --webhook-cert-dir): removed on stop,
        #: since it holds the webhook's private key.
        self._own_cert_dir: Path | None = None
        self._tls_lock = threading.Lock()
        self.health: HealthServer | None = None
        self.elector: LeaderElector | None = None
        self.leading = threading.Event()
        self.controllers_running = threading.Event()
        self.done = threading.Event()
        self.exit_code = 0
        self._lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> Coordinator:
        if self.cfg.webhook_client_names and self.cfg.webhook_client_ca is None:
            raise StartupError("--webhook-client-name needs --webhook-client-ca (the CA that signs the API "
                               "server's webhook client certificate)")
        try:
            self.health = HealthServer(self.cfg.host, self.cfg.port, lambda: True, self.ready, metrics.render,
                                       name="coordinator").start()
        except OSError as exc:
            raise listen_error(exc, self.cfg.host, self.cfg.port, "--port", "--bind") from None
        if self.cfg.webhook_cert_secret:
            self._start_cert_manager()
        elif self.cfg.webhook_cert_dir is not None:
            self._start_webhooks(self.cfg.webhook_cert_dir)
        if self._source is not None:  # after the ports: each start-up problem is named by its own flag
            check_api_server(self.kube.api_client, self._source)
        self.view = ClusterView.build(self.kube, watch_timeout=self.cfg.watch_timeout,
                                      missing_group_grace=self.cfg.missing_group_grace,
                                      deleted_node_grace=self.cfg.deleted_node_grace)
        self.wiring = controllers.build_wiring(
            self.view, EventRecorder(self.kube, "modelcache-coordinator", self.cfg.identity),
            controllers.Options(mutate_services=self.cfg.mutate_isvc, workers=self.cfg.workers,
                                install_uid=self._install_uid()))
        self.manager = self.wiring.manager
        self.view.start()
        self.manager.start_informers()
        if self.cfg.discovery_interval > 0:
            threading.Thread(target=self._discovery_loop, name="discovery", daemon=True).start()
        if self.cfg.leader_election:
            self.elector = LeaderElector(
                self.kube, self.cfg.lease_namespace, self.cfg.lease_name, self.cfg.identity,
                lease_duration=self.cfg.lease_duration, renew_deadline=self.cfg.renew_deadline,
                retry_period=self.cfg.retry_period,
                on_started_leading=self._started_leading, on_stopped_leading=self._stopped_leading,
            ).start()
        else:
            self._started_leading()
        return self

    def _install_uid(self) -> str | None:
        """Our namespace's uid (what an uninstall marks released caches with), if we may read it."""
        try:
            ns = self.kube.get_or_none(NAMESPACES, self.cfg.lease_namespace)
        except ApiException as exc:
            log.info("cannot read namespace %s (%s): caches released by an uninstall stay released",
                     self.cfg.lease_namespace, exc.status)
            return None
        return meta(ns).uid or None

    def _discovery_loop(self) -> None:
        """Notice service CRDs installed after start (KServe installed later, or upgraded to a
        version serving LLMInferenceService) and track them without a restart. The two CRDs are
        watched by name, so this costs no request at rest; where the watch is not allowed, one
        cheap ``list?limit=1`` per missing kind per interval instead."""
        wake = threading.Event()
        crds = [Informer(self.kube, CUSTOM_RESOURCE_DEFINITIONS, field_selector=f"metadata.name={name}",
                         watch_timeout=self.cfg.watch_timeout) for name in SERVICE_CRDS]
        for inf in crds:
            inf.add_handler(lambda *_: wake.set())
            inf.start()
        try:
            while not self.done.is_set():
                view = self.view
                if view is None or (view.isvcs is not None and view.llmisvcs is not None):
                    return
                watched = all(inf.synced.is_set() and not inf.stats["errors"] for inf in crds)
                if wake.is_set() or not watched:
                    wake.clear()
                    try:
                        self.track_new_services()
                    except Exception as exc:
                        log.warning("service CRD discovery failed (retrying): %s: %s", type(exc).__name__, exc)
                        wake.set()
                wake.wait(self.cfg.discovery_interval)
        finally:
            for inf in crds:
                inf.stop()

    def track_new_services(self) -> list[str]:
        """Start tracking service kinds the API now serves; returns their kinds."""
        with self._lock:
            if self.done.is_set() or self.view is None or self.wiring is None:
                return []
            found = self.view.discover_services()
            new_controllers = []
            for inf, res in found:
                new_controllers += controllers.wire_services(self.wiring, inf, res)
                inf.start()
                log.info("%s (%s) is served now: tracking it", res.kind, res.api_version)
            if self.controllers_running.is_set():  # else they start with the others on leadership
                for ctl in new_controllers:
                    ctl.start()
            return [res.kind for _inf, res in found]

    def _start_webhooks(self, cert_dir: Path) -> None:
        if self.cfg.self_signed and not (cert_dir / CERT_FILE).exists():
            try:
                generate_self_signed(cert_dir, [socket.gethostname(), "localhost", "127.0.0.1"])
            except OSError as exc:
                raise StartupError(
                    f"--webhook-cert-dir {cert_dir}: cannot write a self-signed pair there ({exc.strerror or exc}); "
                    "point --webhook-cert-dir at a writable directory") from None
            log.warning("generated a self-signed webhook certificate in %s (development only)", cert_dir)
        self.tls = load_tls(cert_dir, self.cfg.webhook_client_ca).start()
        lookup = ApiLookup(self.kube, recheck=self.cfg.discovery_interval or 30.0)
        routes: dict[str, AdmissionHandler] = {
            "/mutate-pods": PodMutator(lookup, self.cfg.pod_rewrite, self.cfg.pod_fail_closed),
            "/mutate-services": ServiceDefaulter(lookup),
            "/validate-localmodelcaches": CacheValidator(lookup, namespaced=False),
            "/validate-localmodelnamespacecaches": CacheValidator(lookup, namespaced=True),
        }
        # The one route with side effects: at the secret path only (coordinator/uninstallpath.py).
        uninstall = UninstallHook(self.kube, self.cfg.lease_namespace)
        self.uninstall_path = guard = UninstallPath(self.kube, watch_timeout=self.cfg.watch_timeout).start()

        def route(path: str) -> AdmissionHandler | None:
            token = path[len(UNINSTALL_PREFIX) + 1:] if path.startswith(UNINSTALL_PREFIX + "/") else None
            if token is not None:
                return uninstall if guard.accepts(token) else None
            return routes.get(path)

        try:
            self.webhooks = WebhookServer(self.cfg.webhook_host, self.cfg.webhook_port, route,
                                          self.tls.context, client_names=self.cfg.webhook_client_names).start()
        except OSError as exc:
            raise listen_error(exc, self.cfg.webhook_host, self.cfg.webhook_port, "--webhook-port", "--bind") from None
        # The address it is bound to (was ":18202" while bound to 127.0.0.1 only).
        log.info("webhooks serving on %s", _host_port(self.cfg.webhook_host, self.webhooks.port))

    def _start_cert_manager(self) -> None:
        """Webhooks on our own certificate: they start once the first pair is written (retried in
        the background while the API server cannot be reached), and reload on every rotation."""
        cfg = self.cfg
        assert cfg.webhook_cert_secret
        cert_dir = cfg.webhook_cert_dir
        if cert_dir is None:
            cert_dir = self._own_cert_dir = Path(tempfile.mkdtemp(prefix="modelcache-webhook-"))
        settings = CertSettings(namespace=cfg.lease_namespace, secret=cfg.webhook_cert_secret,
                                service=cfg.webhook_service, extra_hosts=tuple(cfg.webhook_cert_hosts),
                                cert_validity=cfg.webhook_cert_validity, ca_validity=cfg.webhook_ca_validity,
                                check_interval=cfg.webhook_cert_check)

        def rotated() -> None:
            with self._tls_lock:
                if self.done.is_set():
                    return
                if self.webhooks is None:
                    try:
                        self._start_webhooks(cert_dir)
                    except Exception as exc:  # the port is taken: as fatal as at start
                        log.error("webhooks cannot start: %s", exc)
                        self.exit_code = 2
                        self.done.set()
                elif self.tls is not None:
                    self.tls.reload()

        self.certs = WebhookCerts(self.kube, settings, cert_dir, on_rotated=rotated).start(first_sync_timeout=0)

    def _started_leading(self) -> None:
        self.leading.set()
        metrics.LEADER.set(1)
        # Informer sync can take longer than a lease renewal period: never block the elector.
        threading.Thread(target=self._run_controllers, name="controllers", daemon=True).start()

    def _run_controllers(self) -> None:
        try:
            with self._lock:
                if self.done.is_set() or self.manager is None:
                    return
                self.manager.start_controllers(gate=self.may_act)
            self.controllers_running.set()
            log.info("controllers running")
        except Exception:
            log.exception("controllers failed to start")
            self.exit_code = 1
            self.done.set()

    def may_act(self) -> bool:
        """Checked before every reconcile: we hold the Lease now (renewed within the renew
        deadline, by our own clock) and every informer follows the server (none is retrying a
        failed watch). A paused or deposed leader, or one whose view fell behind, waits."""
        if self.elector is not None and not self.elector.holds():
            return False
        return self.view is not None and self.view.current()

    def _stopped_leading(self) -> None:
        metrics.LEADER.set(0)
        self.leading.clear()
        if not self.done.is_set():
            log.error("lost the lease: exiting so that only the new leader reconciles")
            self.exit_code = 1
            self.done.set()

    def _shutdown_controllers(self) -> None:
        with self._lock:
            if self.manager is not None:
                self.manager.shutdown(self.elector)  # workers stop, then the lease is released
            elif self.elector is not None:
                self.elector.stop()
            if self.view is not None:
                self.view.stop()
            self.controllers_running.clear()

    def ready(self) -> bool:
        """Webhooks up (if configured), informers synced, and on the leader the workers running."""
        if (self.cfg.webhook_cert_dir is not None or self.cfg.webhook_cert_secret) and self.webhooks is None:
            return False
        if self.view is None or not self.view.synced():
            return False
        return not self.leading.is_set() or self.controllers_running.is_set()

    def stop(self) -> None:
        self.done.set()
        if self.certs is not None:
            self.certs.stop()
        self._shutdown_controllers()
        for server in (self.webhooks, self.health):
            if server is not None:
                server.stop()
        if self.uninstall_path is not None:
            self.uninstall_path.stop()
        if self.tls is not None:
            self.tls.stop()
        if self._own_cert_dir is not None:
            shutil.rmtree(self._own_cert_dir, ignore_errors=True)

    def wait(self) -> int:
        self.done.wait()
        return self.exit_code


def _host_port(host: str, port: int) -> str:
    """``127.0.0.1:8443``, ``[::1]:8443``; every address (``::``, ``0.0.0.0``, "") as ``*:8443``."""
    if host in ("", "::", "0.0.0.0"):
        return f"*:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
