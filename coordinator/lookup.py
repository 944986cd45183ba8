"""Reads the webhooks need, straight from the API (fresh, and on every replica, leader or not)."""

from __future__ import annotations

import time
from typing import Any

from coordinator.urimatch import CacheRef
from coordinator.view import LLMISVC_VERSIONS, llm_resource, served
from modelcache.kube.client import (
    INFERENCE_SERVICES,
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    Kube,
    Resource,
)
from modelcache.kube.objects import meta


class ApiLookup:
    def __init__(self, kube: Kube, recheck: float = 30.0) -> None:
        self.kube = kube
        self.recheck = recheck
        self._services: list[Resource] | None = None
        self._checked_at = 0.0

    def cache(self, namespace: str | None, name: str) -> dict[str, Any] | None:
        if namespace:
            return self.kube.get_or_none(LOCAL_MODEL_NAMESPACE_CACHES, name, namespace)
        return self.kube.get_or_none(LOCAL_MODEL_CACHES, name)

    def cluster_caches(self) -> list[dict[str, Any]]:
        return list(self.kube.list(LOCAL_MODEL_CACHES).get("items") or [])

    def cache_refs(self, namespace: str) -> tuple[list[CacheRef], list[CacheRef]]:
        def live(items: list[dict[str, Any]]) -> list[CacheRef]:
            return [CacheRef.of(o) for o in items if not meta(o).deleting]
        ns_items = self.kube.list(LOCAL_MODEL_NAMESPACE_CACHES, namespace).get("items") or []
        for o in ns_items:  # list items may omit the namespace in some servers' answers
            o.setdefault("metadata", {}).setdefault("namespace", namespace)
        return live(ns_items), live(self.cluster_caches())

    def group_exists(self, name: str) -> bool:
        return self.group(name) is not None

    def group(self, name: str) -> dict[str, Any] | None:
        return self.kube.get_or_none(LOCAL_MODEL_NODE_GROUPS, name)

    def namespace_caches(self, namespace: str) -> list[dict[str, Any]]:
        return list(self.kube.list(LOCAL_MODEL_NAMESPACE_CACHES, namespace).get("items") or [])

    def service_resources(self) -> list[Resource]:
        """InferenceService and the served LLMInferenceService version: checked once when both are
        served, else again after ``recheck`` seconds (a CRD installed later counts without a restart)."""
        now = time.monotonic()
        if self._services is None or (len(self._services) < 2 and now - self._checked_at >= self.recheck):
            self._checked_at = now
            found = [INFERENCE_SERVICES] if served(self.kube, INFERENCE_SERVICES) else []
            for version in LLMISVC_VERSIONS:
                if served(self.kube, llm_resource(version)):
                    found.append(llm_resource(version))
                    break
            self._services = found
        return self._services

    def llm_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The LLMInferenceService ``namespace/name`` at the served version, if that kind is served."""
        for res in self.service_resources():
            if res.kind == "LLMInferenceService":
                # Listed by name: the coordinator lists and watches services, it does not get them.
                items = self.kube.list(res, namespace, field_selector=f"metadata.name={name}").get("items") or []
                return items[0] if items else None
        return None

    def services_labelled(self, selector: str, namespace: str | None) -> list[tuple[str, dict[str, Any]]]:
        """(kind, service) for every service matching ``selector``."""
        out = []
        for res in self.service_resources():
            for item in self.kube.list(res, namespace, label_selector=selector).get("items") or []:
                out.append((res.kind, item))
        return out
