"""The coordinator's own webhook certificate, without a cluster: what a Secret should hold next
(coordinator/webhookcerts.plan) and the certificates themselves (coordinator/certs)."""

from __future__ import annotations

import datetime as dt
import ssl

from coordinator import certs
from coordinator.webhookcerts import Bundle, CertSettings, plan

S = CertSettings(namespace="modelcache-system", cert_validity=dt.timedelta(days=90),
                 ca_validity=dt.timedelta(days=900))
T0 = dt.datetime(2027, 1, 1, tzinfo=dt.UTC)


def test_a_first_plan_makes_a_ca_and_a_serving_pair_for_the_service_names() -> None:
    bundle, why = plan(None, S, T0)
    assert why == ["no CA yet", "no serving certificate yet"]
    (serving,) = certs.parse_certs(bundle.serving.cert)
    assert {"modelcache-coordinator-webhook.modelcache-system.svc",
            "modelcache-coordinator-webhook.modelcache-system.svc.cluster.local"} <= serving.hosts
    assert certs.signed_by(bundle.serving.cert, bundle.ca.cert) and certs.keys_match(bundle.serving)
    assert bundle.trusted == bundle.ca.cert
    # What the API server does with caBundle: verify the serving certificate against it.
    ctx = ssl.create_default_context(cadata=bundle.trusted.decode())
    assert ctx.get_ca_certs()[0]["subject"]


def test_nothing_changes_until_a_third_of_a_life_is_left() -> None:
    bundle, _ = plan(None, S, T0)
    assert plan(bundle, S, T0 + dt.timedelta(days=59))[1] == []
    renewed, why = plan(bundle, S, T0 + dt.timedelta(days=61))
    assert why == ["the serving certificate is due"]
    assert renewed.ca == bundle.ca and renewed.serving != bundle.serving and renewed.trusted == bundle.trusted


def test_a_renewed_ca_is_trusted_beside_the_old_one_until_that_expires() -> None:
    bundle, _ = plan(None, S, T0)
    at = T0 + dt.timedelta(days=601)  # a third of 900 days left
    renewed, why = plan(bundle, S, at)
    assert why == ["the CA is due for renewal", "the serving certificate is due"]
    assert len(certs.parse_certs(renewed.trusted)) == 2 and renewed.trusted.startswith(renewed.ca.cert)
    assert certs.signed_by(renewed.serving.cert, renewed.ca.cert)
    assert not certs.signed_by(renewed.serving.cert, bundle.ca.cert)
    # Once the old CA has expired it leaves the bundle.
    later, why = plan(renewed, S, T0 + dt.timedelta(days=901))
    assert "an old CA expired" in why and certs.parse_certs(later.trusted) == certs.parse_certs(renewed.ca.cert)


def test_a_broken_or_foreign_secret_is_replaced() -> None:
    bundle, _ = plan(None, S, T0)
    other, _ = plan(None, S, T0)
    mixed = Bundle(bundle.ca, bundle.trusted, other.serving)  # serving pair signed by another CA
    assert plan(mixed, S, T0)[1] == ["the serving certificate is due"]
    renamed = CertSettings(namespace="elsewhere")
    assert plan(bundle, renamed, T0)[1] == ["the serving certificate is due"]  # names another Service
    assert Bundle.from_secret({"data": {"tls.crt": "eA=="}}) is None
    round_trip = Bundle.from_secret({"data": bundle.data()})
    assert round_trip is not None and round_trip.serving == bundle.serving and round_trip.ca == bundle.ca
