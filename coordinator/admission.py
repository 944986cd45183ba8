"""Admission logic: AdmissionReview v1 in, AdmissionReview v1 out.

``/mutate-pods``: serving pods of a cached model get a required node affinity to nodes where
the model is downloaded (and, in rewrite mode, KServe's local-model mount).
``/validate-localmodelcaches`` and ``/validate-localmodelnamespacecaches``: KServe's rules
(unique URI among cluster caches, no delete while a service uses the cache, node groups exist)
plus the immutability of ``sourceModelUri``. A cache whose services are already gone can be
deleted at once (KServe denies until its status refreshes).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coordinator import cachepolicy, podmutate
from coordinator.lookup import ApiLookup
from coordinator.urimatch import (
    defaulter_metadata,
    isvc_storage_uri,
    llmisvc_model_uri,
    match_storage_uri,
    select_cache,
    serving_pvc_name,
    sub_path,
)
from modelcache.errors import ModelcacheError
from modelcache.kube.objects import meta
from modelcache.kube.types import (
    LOCALMODEL_LABEL,
    LOCALMODEL_NAMESPACE_LABEL,
    LOCALMODEL_PVC_ANNOTATION,
    MAX_LABEL_VALUE,
)
from modelcache.kube.views import CacheView
from modelcache.runtime.redact import redact_uri
from modelcache.sources.uri import parse_uri

log = logging.getLogger(__name__)

Review = dict[str, Any]


def response(request: Review, allowed: bool, message: str = "", patch: list[dict[str, Any]] | None = None,
             code: int = 403) -> Review:
    resp: dict[str, Any] = {"uid": (request.get("request") or {}).get("uid", ""), "allowed": allowed}
    if not allowed:
        resp["status"] = {"code": code, "message": message, "reason": "Forbidden" if code == 403 else ""}
    elif message:
        resp["warnings"] = [message]
    if patch:
        resp["patchType"] = "JSONPatch"
        resp["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}


# -- pods -------------------------------------------------------------------------------------


#: Labels KServe's LLMInferenceService controller puts on its workload pods (llmisvc/workload_*.go).
LLM_PART_OF = ("app.kubernetes.io/part-of", "llminferenceservice")
LLM_NAME_LABEL = "app.kubernetes.io/name"


def pod_target(pod: dict[str, Any], namespace: str, lookup: ApiLookup,
               by_uri: bool = False) -> podmutate.PodTarget | None:
    """The cache a serving pod reads its model from, which decides its placement; None: it does
    not read one. KServe mounts the cache only into pods whose service carries the cache label
    (its pod mutator and LLMInferenceService controller check that label alone); a pod without it
    (``localModel.enabled: false``, where KServe's defaulter strips it; a service created before its
    cache) downloads its model itself and may run anywhere, so it is not pinned. ``by_uri``: our
    own rewrite mounts the cache (``--pod-rewrite on``), so a pod is matched by its URI as well."""
    labels, annotations = meta(pod).labels, meta(pod).annotations
    source = annotations.get(podmutate.SOURCE_URI_ANNOTATION)
    if labels.get(LLM_PART_OF[0]) == LLM_PART_OF[1] and labels.get(LLM_NAME_LABEL):
        # An LLMInferenceService's pod carries neither the cache label nor the source annotation:
        # its service does (KServe's defaulter or ours labelled it), and its spec.model.uri.
        svc = lookup.llm_service(namespace, labels[LLM_NAME_LABEL])
        if svc is None:
            return None
        labels, annotations = meta(svc).labels, meta(svc).annotations
        source = ((svc.get("spec") or {}).get("model") or {}).get("uri") or None
    name = labels.get(LOCALMODEL_LABEL)
    if name:  # labelled by KServe's (or our) defaulter through the service
        cache = lookup.cache(labels.get(LOCALMODEL_NAMESPACE_LABEL) or None, name)
        if cache is None:
            return None
        view = CacheView(cache)
        uri, groups = view.source_model_uri, view.node_groups or [""]
        pvc = annotations.get(LOCALMODEL_PVC_ANNOTATION) or serving_pvc_name(name, groups[0])
        sub = sub_path(uri, source) if source and match_storage_uri(uri, source) else ""
        return podmutate.PodTarget(uri, pvc, sub)
    if source and by_uri:
        match = select_cache(source, namespace, annotations, *lookup.cache_refs(namespace))
        if match is not None:
            return podmutate.PodTarget(match.cache.uri, match.pvc_name, match.sub_path)
    return None


@dataclass
class PodMutator:
    lookup: ApiLookup
    rewrite: bool = False
    fail_closed: bool = False  # failure policy for our own errors: deny (Fail) or admit unchanged (Ignore)

    def __call__(self, review: Review) -> Review:
        req = review.get("request") or {}
        pod = req.get("object") or {}
        namespace = req.get("namespace") or meta(pod).namespace or "default"
        try:
            target = pod_target(pod, namespace, self.lookup, by_uri=self.rewrite)
        except Exception as exc:
            log.warning("pod admission: cache lookup failed: %s", exc)
            if self.fail_closed:
                return response(review, False, f"modelcache: cannot look up the model cache: {exc}", code=500)
            return response(review, True, "modelcache: cache lookup failed; pod admitted without placement")
        if target is None:
            return response(review, True)
        return response(review, True, patch=podmutate.json_patch(pod, podmutate.mutate(pod, target, self.rewrite)))


# -- services ---------------------------------------------------------------------------------


def metadata_json_patch(obj: dict[str, Any], labels: dict[str, str | None],
                        annotations: dict[str, str | None]) -> list[dict[str, Any]]:
    """RFC 6902 ops setting ``labels``/``annotations`` (None: remove the key) on ``obj``."""
    # Read from the dict, not meta(): the ops differ for an absent map and an empty one, which a view hides.
    raw = obj.get("metadata") or {}
    ops: list[dict[str, Any]] = []
    for name, want in (("labels", labels), ("annotations", annotations)):
        have = raw.get(name)
        if not isinstance(have, dict):
            values = {k: v for k, v in want.items() if v is not None}
            if values:
                ops.append({"op": "add", "path": f"/metadata/{name}", "value": values})
            continue
        for key, value in want.items():
            path = f"/metadata/{name}/{podmutate.escape_pointer(key)}"
            if value is None and key in have:
                ops.append({"op": "remove", "path": path})
            elif value is not None and have.get(key) != value:
                ops.append({"op": "add", "path": path, "value": value})
    return ops


@dataclass
class ServiceDefaulter:
    """KServe's InferenceService / LLMInferenceService defaulter for the local-model metadata, at
    admission (CREATE and UPDATE), as KServe applies it: the URI read where KServe's defaulter reads
    it (custom containers' ``STORAGE_URI`` included: ``urimatch.isvc_storage_uri``), then the cache
    label and annotations of the first matching cache, or none of them; no URI, no change. Set
    only when the service is admitted, so a cache created or deleted later never changes a
    running service (its labels reach the pod template: a change would roll it out, which KServe
    never does)."""

    lookup: ApiLookup

    def __call__(self, review: Review) -> Review:
        req = review.get("request") or {}
        obj = req.get("object") or {}
        kind = (req.get("kind") or {}).get("kind") or obj.get("kind") or ""
        namespace = req.get("namespace") or meta(obj).namespace or "default"
        uri = llmisvc_model_uri(obj) if kind == "LLMInferenceService" else isvc_storage_uri(obj)
        if uri is None:
            # No URI we can read (a custom container without STORAGE_URI, a storage: spec): as
            # KServe's defaulter, leave the labels as they are. This webhook runs after KServe's,
            # so removing them here would undo what KServe's own defaulter just decided.
            return response(review, True)
        try:
            match = select_cache(uri, namespace, meta(obj).annotations,
                                 *self.lookup.cache_refs(namespace))
        except Exception as exc:
            log.warning("service admission: cache lookup failed: %s", exc)
            return response(review, True, "modelcache: cannot look up model caches; local-model labels unchanged")
        return response(review, True, patch=metadata_json_patch(obj, *defaulter_metadata(match)))


# -- caches -----------------------------------------------------------------------------------


@dataclass
class CacheValidator:
    lookup: ApiLookup
    namespaced: bool

    @property
    def kind(self) -> str:
        return "LocalModelNamespaceCache" if self.namespaced else "LocalModelCache"

    def __call__(self, review: Review) -> Review:
        req = review.get("request") or {}
        op = req.get("operation")
        checks: dict[str, Callable[[Review], str | None]] = {
            "CREATE": self._create_or_update, "UPDATE": self._create_or_update, "DELETE": self._delete,
        }
        check = checks.get(str(op))
        denial = check(req) if check else None
        if denial is None and op == "CREATE":
            return response(review, True, self._twin_warning(req) or "")
        return response(review, denial is None, denial or "")

    def _twin_warning(self, req: Review) -> str | None:
        """A warning (``kubectl`` prints it) when another cache names the same source spelled
        differently (``s3://b/m/`` beside ``s3://b/m``): KServe keys a model by the URI's exact
        text, so the two are downloaded and stored twice. Allowed, as KServe allows it."""
        obj = req.get("object") or {}
        name, uri = meta(obj).name, CacheView(obj).source_model_uri
        try:
            mine = parse_uri(uri).identity
        except ModelcacheError:
            return None
        caches = self.lookup.cluster_caches() if not self.namespaced else []
        for other in caches:
            om, theirs = meta(other), CacheView(other).source_model_uri
            if om.name == name or om.deleting or theirs == uri:
                continue
            try:
                same = parse_uri(theirs).identity == mine
            except ModelcacheError:
                continue
            if same:
                return (f"LocalModelCache {om.name} caches the same source spelled {redact_uri(theirs)}: KServe "
                        f"keys a model by the URI's exact text, so {redact_uri(uri)} is downloaded and stored again "
                        "on every node; use one spelling to keep one copy")
        return None

    def _create_or_update(self, req: Review) -> str | None:
        obj, old = req.get("object") or {}, req.get("oldObject") or None
        cache = CacheView(obj)
        m, spec = cache.meta, cache.spec
        if m.deleting:
            return None
        uri = cache.source_model_uri
        if old and CacheView(old).source_model_uri != uri:
            return "StorageUri is immutable"
        name = m.name
        if why := cachepolicy.refusal(self.kind, name, spec, self.namespaced):
            return why
        if not old and len(name) > MAX_LABEL_VALUE:
            return (f"{self.kind} name {name} has {len(name)} characters; at most {MAX_LABEL_VALUE}: the "
                    f"InferenceServices using a cache are labelled {LOCALMODEL_LABEL}=<its name> (KServe's "
                    f"contract), and a label value has at most {MAX_LABEL_VALUE} characters")
        if not self.namespaced:
            for other in self.lookup.cluster_caches():
                om = meta(other)
                if om.name != name and not om.deleting and CacheView(other).source_model_uri == uri:
                    return f"LocalModelCache {om.name} has the same StorageURI {redact_uri(uri)}"
        for group in cache.node_groups:
            if not self.lookup.group_exists(group):
                return f"NodeGroup {group} not found: create the LocalModelNodeGroup first"
        if self.namespaced:
            ns = str(m.namespace or req.get("namespace") or "")
            return cachepolicy.share_refusal(name, ns, spec, self.lookup.namespace_caches(ns), self.lookup.group)
        return None

    def _delete(self, req: Review) -> str | None:
        obj = req.get("oldObject") or {}
        m = meta(obj)
        name = m.name or req.get("name", "")
        ns = m.namespace or req.get("namespace") or None
        if len(name) > MAX_LABEL_VALUE:
            return None  # no service can carry it as a label (refused at creation since): nothing uses it
        selector = f"{LOCALMODEL_LABEL}={name}"
        if self.namespaced:
            selector += f",{LOCALMODEL_NAMESPACE_LABEL}={ns}"
        else:
            selector += f",!{LOCALMODEL_NAMESPACE_LABEL}"
        users = self.lookup.services_labelled(selector, ns if self.namespaced else None)
        users = [(k, s) for k, s in users if not meta(s).deleting]
        if users:
            kind, svc = users[0]
            return f"{self.kind} {name} is being used by {kind} {meta(svc).key}"
        return None
