"""deploy/ on an empty real control plane: `kubectl apply -k deploy/` alone gives a working install
(the coordinator makes its own webhook certificate and patches its CA in; the API server calls the
webhooks through their Service). `kubectl delete -k` with caches present runs on real nodes, where
the kubelets stop our pods: tests/test_realnodes_deploy.py.

No kubelet runs here: the coordinator is a process started with the Deployment's command, args and
env and its ServiceAccount's token, and the webhook Service reaches it through an EndpointSlice to
this host's address (what the EndpointSlice controller would publish for a ready pod)."""

from __future__ import annotations

import base64
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from modelcache.kube.client import (
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    SECRETS,
    Kube,
)
from modelcache.kube.types import CACHE_FINALIZER, NAMESPACE_CACHE_FINALIZER
from tests.coordinator_util import make_group, make_namespace
from tests.deploy_util import DEPLOY, NAMESPACE, publish_webhook_endpoint, start_deployed_coordinator
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(600)

URI = "s3://models/llm"
VALIDATOR = "modelcache-cache-validator"
MUTATOR = "modelcache-pod-mutator"


def cache_yaml(name: str, uri: str, groups: list[str], namespace: str | None = None) -> str:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    return yaml.safe_dump({"apiVersion": "serving.kserve.io/v1alpha1",
                           "kind": "LocalModelNamespaceCache" if namespace else "LocalModelCache",
                           "metadata": meta, "spec": {"sourceModelUri": uri, "modelSize": "1Gi", "nodeGroups": groups}})


def ca_bundles(cluster: Cluster) -> set[str]:
    out = set()
    for kind, name in (("mutatingwebhookconfiguration", MUTATOR), ("validatingwebhookconfiguration", VALIDATOR)):
        config = json.loads(cluster.kubectl("get", kind, name, "-o", "json").stdout)
        out |= {(h.get("clientConfig") or {}).get("caBundle", "") for h in config["webhooks"]}
    return out


def webhook_secret(kube: Kube) -> dict[str, Any] | None:
    return kube.get_or_none(SECRETS, "modelcache-webhook-tls", NAMESPACE)


def install(cluster: Cluster, tmp_path: Any) -> Any:
    """`kubectl apply -k deploy/`, then what the cluster would do: run the coordinator's pod."""
    cluster.kubectl("apply", "-k", str(DEPLOY))
    cluster.kubectl("wait", "--for", "condition=Established", "--timeout", "60s", "crd", "--all")
    coordinator = start_deployed_coordinator(cluster, tmp_path / "coordinator")
    publish_webhook_endpoint(cluster, coordinator.webhook_port)
    return coordinator


def test_apply_alone_installs_a_working_coordinator(
    cluster_factory: Callable[..., Cluster], tmp_path: Any
) -> None:
    cluster = cluster_factory(baseline=False)
    admin = cluster.kube()
    coordinator = install(cluster, tmp_path)
    try:
        # The coordinator made its CA and serving pair, and every webhook trusts that CA.
        wait_until(lambda: webhook_secret(admin) is not None, timeout=30, what="the webhook Secret")
        ca = (webhook_secret(admin) or {})["data"]["ca.crt"]
        wait_until(lambda: ca_bundles(cluster) == {ca}, timeout=30, what="caBundle on every webhook")

        cluster.register_node("gpu-1", {"kserve/localmodel": "worker"})
        make_group(admin, "workers")
        # The API server calls the validator over TLS (verified against the patched CA) through the Service.
        wait_until(lambda: cluster.kubectl("create", "-f", "-", input=cache_yaml("llm", URI, ["workers"]),
                                           check=False).returncode == 0, timeout=30, what="a cache admitted")
        dup = cluster.kubectl("create", "-f", "-", input=cache_yaml("llm2", URI, ["workers"]), check=False)
        assert dup.returncode != 0
        assert 'admission webhook "localmodelcache.modelcache.serving.kserve.io" denied the request' in dup.stderr
        assert f"LocalModelCache llm has the same StorageURI {URI}" in dup.stderr
        # Its serving pair (no --webhook-cert-dir in deploy/) is in a folder of its TMPDIR while it runs...
        (pair_dir,) = (tmp_path / "coordinator" / "tmp").glob("modelcache-webhook-*")
        assert (pair_dir / "tls.key").exists()
    finally:
        coordinator.stop()
    # ... and goes with it: the webhook's private key is not left behind.
    assert list((tmp_path / "coordinator" / "tmp").iterdir()) == []


def test_certificate_rotation_keeps_the_webhooks_called(cluster_factory: Callable[..., Cluster], tmp_path: Any) -> None:
    """Short lifetimes: the serving pair and then the CA are renewed, each once a third of its life
    is left (not before), while the API server keeps calling the fail-closed validator: the new CA
    is trusted before anything it signed is served."""
    import datetime as dt

    from coordinator.certs import parse_certs

    cluster = cluster_factory(baseline=False)
    admin = cluster.kube()
    cluster.kubectl("apply", "-k", str(DEPLOY))
    cluster.kubectl("wait", "--for", "condition=Established", "--timeout", "60s", "crd", "--all")
    coordinator = start_deployed_coordinator(cluster, tmp_path / "coordinator", "--webhook-cert-validity", "30",
                                             "--webhook-ca-validity", "75", "--webhook-cert-check", "1")
    publish_webhook_endpoint(cluster, coordinator.webhook_port)
    try:
        make_group(admin, "workers")

        def pair() -> tuple[bytes, bytes]:
            data = (webhook_secret(admin) or {}).get("data") or {}
            return base64.b64decode(data.get("ca.crt", "")), base64.b64decode(data.get("tls.crt", ""))

        wait_until(lambda: pair()[1] != b"", timeout=30, what="the first pair")
        seen: list[tuple[bytes, bytes]] = []  # (trusted CAs, serving certificate), in order, once each
        n = 0
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and (len(seen) < 4 or len({parse_certs(c)[0].issuer for _, c in seen}) < 2):
            cas, cert = pair()
            if not seen or seen[-1][1] != cert:
                seen.append((cas, cert))
            # Every write goes through the fail-closed validator: one refused = a webhook call that failed.
            out = cluster.kubectl("create", "-f", "-", input=cache_yaml(f"c{n}", f"{URI}/{n}", ["workers"]),
                                  check=False)
            assert out.returncode == 0, f"{out.stderr}\n{coordinator.log()[-3000:]}"
            n += 1
            time.sleep(0.5)
        issuers = [parse_certs(cert)[0].issuer for _, cert in seen]
        assert len(seen) >= 4, "the serving certificate was not renewed three times"
        assert len(set(issuers)) >= 2, "the CA was not renewed"
        slack = dt.timedelta(seconds=2)  # certificate times have whole seconds
        for (_, old), (cas, new) in itertools.pairwise(seen):
            a, b = parse_certs(old)[0], parse_certs(new)[0]
            if a.issuer == b.issuer:  # same CA: renewed because a third of its life was left, not sooner
                assert b.issued + slack >= a.not_after - (a.not_after - a.issued) / 3, (a, b)
            else:  # a new CA: the old one is still trusted beside it
                assert len(parse_certs(cas)) == 2
            assert "modelcache-coordinator-webhook.modelcache-system.svc" in b.hosts
        assert "Traceback" not in coordinator.log()
    finally:
        coordinator.stop()


def test_with_the_coordinator_down_only_cache_creation_and_spec_edits_wait(cluster: Cluster) -> None:
    """deploy/'s validating webhooks with nothing serving them (no endpoint: the coordinator is
    down): what fails closed and what does not (docs/operations.md, "Webhooks")."""
    admin = cluster.kube()
    make_group(admin, "workers")
    make_namespace(admin, "team")
    held = {"metadata": {"finalizers": [CACHE_FINALIZER]}}
    cluster.kubectl("create", "-f", "-", input=cache_yaml("llm", URI, ["workers"]))
    cluster.kubectl("create", "-f", "-", input=cache_yaml("nsllm", URI, ["workers"], "team"))
    admin.patch(LOCAL_MODEL_CACHES, "llm", held)
    admin.patch(LOCAL_MODEL_NAMESPACE_CACHES, "nsllm", {"metadata": {"finalizers": [NAMESPACE_CACHE_FINALIZER]}},
                "team")
    cluster.kubectl("apply", "-f", str(DEPLOY / "webhooks" / "validating.yaml"))

    def refused(out: Any) -> bool:
        return out.returncode != 0 and "failed calling webhook" in out.stderr

    # Fail closed: a new cache, and an edit of a cache's spec.
    wait_until(lambda: refused(cluster.kubectl("create", "-f", "-", input=cache_yaml("new", URI + "2", ["workers"]),
                                               check=False)), timeout=20, what="creation refused")
    assert refused(cluster.kubectl("patch", "localmodelcache", "llm", "--type=merge", "-p",
                                   json.dumps({"spec": {"nodeGroups": ["workers", "more"]}}), check=False))
    # Not waiting: metadata-only edits (a finalizer removed by hand), deletes, a namespace's deletion.
    cluster.kubectl("label", "localmodelcache", "llm", "team=ml")
    cluster.kubectl("patch", "localmodelcache", "llm", "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
    cluster.kubectl("delete", "localmodelcache", "llm", "--timeout=30s")
    cluster.kubectl("-n", "team", "patch", "localmodelnamespacecache", "nsllm", "--type=merge", "-p",
                    '{"metadata":{"finalizers":null}}')
    cluster.kubectl("delete", "namespace", "team", "--timeout=60s")
    assert admin.get_or_none(LOCAL_MODEL_CACHES, "llm") is None
