"""The uninstall release (coordinator/uninstall.py) against a leader that is still running.

CI (stop 37) saw ``kubectl delete -k`` leave a serving PVC Pending for ever: the release deleted the
claim before it marked the cache, the leader (alive for moments after the webhook answers)
reconciled the cache whose claim it saw go and made the claim again, bound by name to a PV the
release deleted next. Here the leader's stale reconcile is played by the test, deterministically,
on the real control plane: the release must mark every cache before it deletes any volume, and
delete what such a reconcile made after its first pass."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator import volumes
from coordinator.uninstall import RELEASED_ANNOTATION, release
from modelcache.kube.client import (
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    Kube,
    Resource,
)
from modelcache.kube.types import CACHE_FINALIZER, NAMESPACE_CACHE_FINALIZER
from tests.coordinator_util import make_cache, make_namespace
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until
from tests.test_coordinator_volumes import group

pytestmark = pytest.mark.timeout(120)

MANAGED = "app.kubernetes.io/managed-by=modelcache-coordinator"


class StaleLeader(Kube):
    """The release's client, with the leader's reconcile played beside it: each serving claim the
    release deletes is made again at once, once, from what the leader's informer still held. Notes
    whether the claim's cache was already marked when the release deleted its claim."""

    def __init__(self, kube: Kube, claims: dict[str, dict[str, Any]], caches: dict[str, tuple[Resource, str | None]]):
        super().__init__(kube.api_client)
        self.claims, self.caches = claims, caches
        self.marked_at_delete: dict[str, bool] = {}

    def delete(self, res: Resource, name: str, namespace: str | None = None, **kw: Any) -> Any:
        out = super().delete(res, name, namespace, **kw)
        if res is PERSISTENT_VOLUME_CLAIMS and name in self.claims and name not in self.marked_at_delete:
            cres, cns = self.caches[name]
            cache = self.get(cres, name.removesuffix("-workers"), cns)
            self.marked_at_delete[name] = RELEASED_ANNOTATION in (cache["metadata"].get("annotations") or {})
            body = self.claims[name]
            # As the leader: once its informer saw the claim go (pvc-protection holds it a moment).
            wait_until(lambda: self.get_or_none(PERSISTENT_VOLUME_CLAIMS, name, namespace) is None, timeout=30,
                       what=f"claim {name} gone")
            self.create(PERSISTENT_VOLUME_CLAIMS, {"metadata": {k: body["metadata"][k] for k in (
                "name", "namespace", "labels", "annotations")}, "spec": body["spec"]}, namespace)
        return out


def serving_volumes(kube: Kube, cache: dict[str, Any], grp: dict[str, Any]) -> dict[str, Any]:
    pair = volumes.desired_pairs(cache, {"workers": grp}, [volumes.Use("team", {})])[("team", "workers")]
    kube.create(PERSISTENT_VOLUMES, volumes.pv_body(cache, grp, pair))
    return kube.create(PERSISTENT_VOLUME_CLAIMS, volumes.pvc_body(cache, grp, pair), "team")


def test_the_release_marks_every_cache_before_a_volume_goes_and_sweeps_what_a_stale_leader_made(
        cluster: Cluster) -> None:
    kube = cluster.kube()
    group(kube, "workers")
    grp = kube.get(LOCAL_MODEL_NODE_GROUPS, "workers")
    make_namespace(kube, "team")
    llm = make_cache(kube, "llm", "s3://models/llm", ["workers"])
    nsllm = make_cache(kube, "nsllm", "s3://models/nsllm", ["workers"], namespace="team")
    for res, obj, fin in ((LOCAL_MODEL_CACHES, llm, CACHE_FINALIZER),
                          (LOCAL_MODEL_NAMESPACE_CACHES, nsllm, NAMESPACE_CACHE_FINALIZER)):
        kube.patch(res, obj["metadata"]["name"], {"metadata": {"finalizers": [fin]}}, obj["metadata"].get("namespace"))
    claims = {c["metadata"]["name"]: c for c in (serving_volumes(kube, llm, grp), serving_volumes(kube, nsllm, grp))}
    assert sorted(claims) == ["llm-workers", "nsllm-workers"]
    stale = StaleLeader(kube, claims, {"llm-workers": (LOCAL_MODEL_CACHES, None),
                                       "nsllm-workers": (LOCAL_MODEL_NAMESPACE_CACHES, "team")})

    assert release(stale, "install-1", settle=0.5) == 2

    # Every cache was marked (and its finalizer gone) before the release deleted a claim of it.
    assert stale.marked_at_delete == {"llm-workers": True, "nsllm-workers": True}
    for res, name, ns in ((LOCAL_MODEL_CACHES, "llm", None), (LOCAL_MODEL_NAMESPACE_CACHES, "nsllm", "team")):
        m = kube.get(res, name, ns)["metadata"]
        assert m["annotations"][RELEASED_ANNOTATION] == "install-1" and not m.get("finalizers")
    # The claims the stale reconcile made after the first pass went in the second: nothing of ours
    # is left to stay Pending (the PV controller and pvc-protection finish the deletions).

    def left() -> list[str]:
        return sorted(f"{res.kind}/{v['metadata']['name']}" for res in (PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES)
                      for v in kube.list(res, None, label_selector=MANAGED).get("items") or [])

    wait_until(lambda: not left(), timeout=60, what=f"no serving volume left: {left()}")

    # A second review of the same uninstall (the API server retries) finds the caches released and
    # deletes any volume still made for them; it releases nothing again.
    serving_volumes(kube, kube.get(LOCAL_MODEL_CACHES, "llm"), grp)
    assert release(kube, "install-1", settle=0) == 0
    wait_until(lambda: not left(), timeout=60, what=f"no serving volume left after a retried review: {left()}")
