"""Reconciler for InferenceServices and LLMInferenceServices: KServe's defaulter, continuously
(``--mutate-isvc``, off by default).

KServe sets the local-model label and annotations once, when a service is admitted; so does our
``/mutate-services`` webhook (``admission.ServiceDefaulter``). This keeps them right after that
too: a service created before its cache picks it up, one whose cache is gone loses it. Those
labels reach the service's pod template, so every such change rolls out a running service:
hence off unless asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coordinator import metrics
from coordinator.urimatch import defaulter_metadata, isvc_storage_uri, metadata_patch, select_cache
from coordinator.view import ClusterView
from modelcache.kube.client import Resource
from modelcache.kube.controller import Result
from modelcache.kube.informer import Informer
from modelcache.kube.objects import meta


class ServiceReconciler:
    def __init__(self, view: ClusterView, informer: Informer, res: Resource,
                 uri_of: Callable[[dict[str, Any]], str | None] = isvc_storage_uri) -> None:
        self.view = view
        self.informer = informer
        self.res = res
        self.uri_of = uri_of
        self.name = res.kind

    def __call__(self, key: str) -> Result:
        obj = self.informer.store.get(key)
        if obj is None or meta(obj).deleting:
            return Result()
        m = meta(obj)
        uri = self.uri_of(obj)
        if uri is None:
            return Result()  # no URI to match (KServe's defaulter leaves the labels then, too)
        ns_caches, cluster_caches = self.view.cache_refs()
        match = select_cache(uri, m.namespace or "", m.annotations, ns_caches, cluster_caches)
        patch = metadata_patch(obj, *defaulter_metadata(match))
        if patch:
            patch["metadata"]["resourceVersion"] = m.resource_version or None
            metrics.WRITES.labels(self.res.kind, "patch").inc()
            self.view.kube.patch(self.res, m.name, patch, m.namespace)
        return Result()
