"""The coordinator's own webhook certificate: a CA and a serving pair kept in one Secret, the CA
patched into our webhook configurations, both renewed long before they expire.

What mature operators do without cert-manager (open-policy-agent/cert-controller, Knative):

* The Secret (``ca.crt``, ``ca.key``, ``tls.crt``, ``tls.key``) lives in the coordinator's namespace;
  only the coordinator's RBAC may read it. Every replica reads the same Secret (two racing to create
  it: one gets 409 and takes the other's), writes the pair into a private directory and serves it.
* ``caBundle`` of every webhook in our two configurations is the Secret's ``ca.crt``. It is patched
  whenever it differs (also after someone re-applies the manifests without it).
* Renewal: the serving certificate when less than a third of its life is left, or when it no
  longer names the service or was not signed by the current CA; the CA the same way. A new CA is
  added to ``ca.crt`` (next to the old one, kept while it is valid) and patched into the webhook
  configurations *before* the Secret with the certificate it signed is written, so the API server
  trusts a certificate before any replica serves it.

Reads come from two watches (the Secret, the configurations; each by name, as RBAC allows), so
nothing is requested at rest; a timer re-checks expiry every ``check_interval``.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from coordinator import certs
from modelcache.kube.client import SECRETS, Kube, Resource, error_message
from modelcache.kube.informer import Informer
from modelcache.kube.objects import namespaced_key
from modelcache.kube.status import update_if_changed
from modelcache.runtime.loop import Loop

log = logging.getLogger(__name__)

MUTATING = Resource("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations",
                    "MutatingWebhookConfiguration", False)
VALIDATING = Resource("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations",
                      "ValidatingWebhookConfiguration", False)
CA_CERT, CA_KEY = "ca.crt", "ca.key"
YEAR = dt.timedelta(days=365)


@dataclass(frozen=True)
class CertSettings:
    namespace: str
    secret: str = "modelcache-webhook-tls"
    service: str = "modelcache-coordinator-webhook"
    #: (kind, name) of the webhook configurations whose every webhook gets our CA.
    configurations: tuple[tuple[Resource, str], ...] = ((MUTATING, "modelcache-pod-mutator"),
                                                        (VALIDATING, "modelcache-cache-validator"))
    ca_validity: dt.timedelta = 10 * YEAR
    cert_validity: dt.timedelta = YEAR
    #: Renew once less than this fraction of a certificate's life is left.
    renew_fraction: float = 1 / 3
    check_interval: float = 3600.0
    #: More names or IPs for the serving certificate (a webhook given by URL, tests).
    extra_hosts: tuple[str, ...] = ()

    @property
    def hosts(self) -> list[str]:
        svc, ns = self.service, self.namespace
        return [f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local", f"{svc}.{ns}", svc, *self.extra_hosts]


@dataclass
class Bundle:
    """What the Secret holds: the current CA (pair), every CA still trusted, the serving pair."""

    ca: certs.Pair
    trusted: bytes
    serving: certs.Pair

    def data(self) -> dict[str, str]:
        raw = {CA_CERT: self.trusted, CA_KEY: self.ca.key, certs.CERT_FILE: self.serving.cert,
               certs.KEY_FILE: self.serving.key}
        return {k: base64.b64encode(v).decode() for k, v in raw.items()}

    @classmethod
    def from_secret(cls, secret: dict[str, Any]) -> Bundle | None:
        data = secret.get("data") or {}
        try:
            raw = {k: base64.b64decode(data[k]) for k in (CA_CERT, CA_KEY, certs.CERT_FILE, certs.KEY_FILE)}
        except (KeyError, ValueError):
            return None
        pems = _split_pem(raw[CA_CERT])
        if not pems:
            return None
        return cls(certs.Pair(pems[0], raw[CA_KEY]), raw[CA_CERT], certs.Pair(raw[certs.CERT_FILE],
                                                                             raw[certs.KEY_FILE]))


def _split_pem(bundle: bytes) -> list[bytes]:
    marker = b"-----END CERTIFICATE-----"
    return [part.strip() + b"\n" + marker + b"\n" for part in bundle.split(marker)[:-1] if part.strip()]


def plan(current: Bundle | None, settings: CertSettings, now: dt.datetime) -> tuple[Bundle, list[str]]:
    """The bundle the Secret should hold, and why it differs from ``current`` ([] = keep it)."""
    why: list[str] = []
    ca, trusted = (current.ca, current.trusted) if current else (None, b"")
    if ca is None or not _ca_ok(ca, settings, now):
        why.append("no CA yet" if ca is None else "the CA is due for renewal")
        ca = certs.new_ca(f"modelcache-webhook-ca-{secrets.token_hex(4)}", settings.ca_validity, now)
    # Trust the current CA and every older one still valid (certificates they signed may still be served).
    keep = [pem for pem in _split_pem(trusted) if pem != ca.cert and _valid(pem, now)]
    new_trusted = b"".join([ca.cert, *keep])
    if current is not None and new_trusted != current.trusted and not why:
        why.append("an old CA expired")
    serving = current.serving if current else None
    if serving is None or not _serving_ok(serving, ca, settings, now):
        why.append("no serving certificate yet" if serving is None else "the serving certificate is due")
        serving = certs.issue_serving(ca, settings.hosts, settings.cert_validity, now)
    return Bundle(ca, new_trusted, serving), why


def _valid(pem: bytes, now: dt.datetime) -> bool:
    try:
        (info,) = certs.parse_certs(pem)
    except ValueError:
        return False
    return info.not_before <= now < info.not_after


def _ca_ok(ca: certs.Pair, settings: CertSettings, now: dt.datetime) -> bool:
    try:
        (info,) = certs.parse_certs(ca.cert)
    except ValueError:
        return False
    return certs.keys_match(ca) and not info.due(now, settings.renew_fraction)


def _serving_ok(pair: certs.Pair, ca: certs.Pair, settings: CertSettings, now: dt.datetime) -> bool:
    try:
        info = certs.parse_certs(pair.cert)[0]
    except (ValueError, IndexError):
        return False
    return (certs.keys_match(pair) and certs.signed_by(pair.cert, ca.cert) and set(settings.hosts) <= info.hosts
            and not info.due(now, settings.renew_fraction))


@dataclass
class WebhookCerts:
    """Keeps the Secret, the served pair (``cert_dir``) and the webhook configurations' CA current."""

    kube: Kube
    settings: CertSettings
    cert_dir: Path
    #: Called after the served pair changed on disk (the TLS context reloads it).
    on_rotated: Callable[[], None] | None = None
    clock: Callable[[], dt.datetime] = field(default=lambda: dt.datetime.now(dt.UTC))
    #: Counters a test or /metrics can read.
    stats: dict[str, int] = field(default_factory=lambda: {"rotations": 0, "injections": 0, "errors": 0})

    def __post_init__(self) -> None:
        s = self.settings
        self.secret_inf = Informer(self.kube, SECRETS, s.namespace, field_selector=f"metadata.name={s.secret}")
        self.config_infs = [Informer(self.kube, res, field_selector=f"metadata.name={name}")
                            for res, name in s.configurations]
        self._served: bytes | None = None
        self._first = threading.Event()  # the first pair is on disk
        self._delay = 1.0  # the wait after a failed round: doubles to a minute
        # A round every check interval, and at once when the Secret or a configuration changes.
        self._loop = Loop("webhook-certs", self._round, self.settings.check_interval, logger=log)
        for inf in (self.secret_inf, *self.config_infs):
            inf.add_handler(lambda *_: self._loop.wake.set())

    # -- one round -------------------------------------------------------------------------------
    def sync(self) -> Bundle:
        """Make the Secret, the webhook configurations and the served files agree; returns the bundle.

        Raises on API errors (the loop retries)."""
        s = self.settings
        fresh = False
        for _ in range(5):
            secret = self._secret(fresh)
            current = Bundle.from_secret(secret) if secret else None
            bundle, why = plan(current, s, self.clock())
            if not why:
                self._inject(bundle.trusted)
                self._serve(bundle)
                return bundle
            if not fresh:  # decide a write on the stored Secret, not on a watch that may lag behind it
                fresh = True
                continue
            log.info("webhook certificate: %s; writing Secret %s/%s", "; ".join(why), s.namespace, s.secret)
            # Trust first, then serve (module docstring); what is trusted now stays trusted until the
            # Secret is written, so a replica that wins a race keeps being called meanwhile.
            self._inject(bundle.trusted, keep_trusted=True)
            try:
                if secret is None:
                    self.kube.create(SECRETS, {"metadata": {"name": s.secret, "namespace": s.namespace, "labels": {
                        "app.kubernetes.io/part-of": "modelcache", "app.kubernetes.io/managed-by":
                            "modelcache-coordinator"}}, "type": "Opaque", "data": bundle.data()}, s.namespace)
                else:
                    body = dict(secret)
                    body["data"] = bundle.data()
                    self.kube.replace(SECRETS, body, s.namespace)
            except ApiException as exc:
                if exc.status == 409:  # another replica wrote it first: take theirs
                    fresh = True
                    continue
                raise
            self.stats["rotations"] += 1
            self._serve(bundle)
            return bundle
        raise RuntimeError(f"Secret {s.namespace}/{s.secret} kept changing under us")

    def _secret(self, fresh: bool) -> dict[str, Any] | None:
        """The Secret from the watch, or from a GET right after a conflict (the watch may lag)."""
        if fresh or not self.secret_inf.synced.is_set():
            return self.kube.get_or_none(SECRETS, self.settings.secret, self.settings.namespace)
        return self.secret_inf.store.get(namespaced_key(self.settings.namespace, self.settings.secret))

    def _inject(self, trusted: bytes, keep_trusted: bool = False) -> None:
        """Set every webhook's caBundle to ``trusted``; ``keep_trusted`` adds the CAs already there
        (still valid ones) instead of dropping them."""
        for (res, name), inf in zip(self.settings.configurations, self.config_infs, strict=True):
            cached = inf.store.get(name) if inf.synced.is_set() and not keep_trusted else \
                self.kube.get_or_none(res, name)
            if cached is None:
                continue  # not installed (yet): its ADDED event brings us back
            want = base64.b64encode(self._bundle_for(cached, trusted, keep_trusted)).decode()
            if all((h.get("clientConfig") or {}).get("caBundle") == want for h in cached.get("webhooks") or []):
                continue

            def set_ca(obj: dict[str, Any], want: str = want) -> None:
                for hook in obj.get("webhooks") or []:
                    hook.setdefault("clientConfig", {})["caBundle"] = want

            if update_if_changed(self.kube, res, name, set_ca, current=cached) is not None:
                self.stats["injections"] += 1
                log.info("webhook certificate: CA bundle set on %s %s", res.kind, name)

    def _bundle_for(self, config: dict[str, Any], trusted: bytes, keep_trusted: bool) -> bytes:
        if not keep_trusted:
            return trusted
        now, have = self.clock(), _split_pem(trusted)
        for hook in config.get("webhooks") or []:
            try:
                current = base64.b64decode((hook.get("clientConfig") or {}).get("caBundle") or "")
            except ValueError:
                continue
            have += [pem for pem in _split_pem(current) if pem not in have and _valid(pem, now)]
        return b"".join(have)

    def _serve(self, bundle: Bundle) -> None:
        served = bundle.serving.cert + bundle.serving.key
        if served == self._served:
            return
        certs.write_pair(self.cert_dir, bundle.serving)
        self._served = served
        if self.on_rotated is not None:
            self.on_rotated()

    # -- loop ------------------------------------------------------------------------------------
    def start(self, first_sync_timeout: float | None = None) -> WebhookCerts:
        """Start the watches and the loop; returns once the first pair is on disk (or the timeout)."""
        for inf in (self.secret_inf, *self.config_infs):
            inf.start()
        self._loop.start()
        self._first.wait(first_sync_timeout)
        return self

    def ready(self) -> bool:
        return self._served is not None

    def _round(self) -> float | None:
        try:
            self.sync()
        except Exception as exc:
            self.stats["errors"] += 1
            delay, self._delay = self._delay, min(self._delay * 2, 60.0)
            log.warning("webhook certificate: %s (retrying in %.0fs)", error_message(exc), delay)
            return delay
        self._first.set()
        self._delay = 1.0
        return None

    def stop(self) -> None:
        self._loop.stop()
        for inf in (self.secret_inf, *self.config_infs):
            inf.stop()
