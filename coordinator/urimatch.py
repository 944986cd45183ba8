"""Which cache serves a model URI, by KServe v0.20's rules, as its pod mutator applies them.

Namespace caches in the service's namespace are tried first, then cluster caches, each in
name order (the API's list order); the first whose URI matches wins. A match is: equal after
stripping one trailing ``/`` from each, or the service URI is the cache URI + ``/`` + a
sub-path. ``serving.kserve.io/nodegroup`` restricts the match to caches listing that group;
``serving.kserve.io/disable-localmodel`` (present, any value) opts the service out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from modelcache.kube.objects import meta, namespaced_key
from modelcache.kube.types import (
    DISABLE_LOCALMODEL_ANNOTATION,
    LOCALMODEL_LABEL,
    LOCALMODEL_NAMESPACE_LABEL,
    LOCALMODEL_PVC_ANNOTATION,
    LOCALMODEL_SOURCEURI_ANNOTATION,
    MAX_LABEL_VALUE,
    NODEGROUP_ANNOTATION,
)
from modelcache.kube.views import CacheView


@dataclass(frozen=True)
class CacheRef:
    """What matching needs of a LocalModelCache / LocalModelNamespaceCache."""

    name: str
    uri: str
    node_groups: tuple[str, ...]
    namespace: str | None = None  # set for a namespace cache

    @property
    def key(self) -> str:
        return namespaced_key(self.namespace, self.name)

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> CacheRef:
        view = CacheView(obj)
        return cls(name=view.meta.name, uri=view.source_model_uri, node_groups=tuple(view.node_groups),
                   namespace=view.meta.namespace)


@dataclass(frozen=True)
class CacheMatch:
    cache: CacheRef
    #: The group the serving PVC is named after: the nodegroup annotation, else the cache's first.
    node_group: str
    sub_path: str  # "" or "/more/path": what the service URI adds to the cache URI

    @property
    def pvc_name(self) -> str:
        return serving_pvc_name(self.cache.name, self.node_group)


def serving_pvc_name(cache: str, group: str) -> str:
    return f"{cache}-{group}"


def _trim(uri: str) -> str:
    return uri[:-1] if uri.endswith("/") else uri


def match_storage_uri(cache_uri: str, uri: str) -> bool:
    cache, want = _trim(cache_uri), _trim(uri)
    return bool(cache) and (want == cache or want.startswith(cache + "/"))


def sub_path(cache_uri: str, uri: str) -> str:
    """The part of ``uri`` below ``cache_uri`` (``""`` or ``/a/b``); call only on a match."""
    return _trim(uri)[len(_trim(cache_uri)):]


def select_cache(
    uri: str | None,
    namespace: str,
    annotations: Mapping[str, str] | None,
    namespace_caches: Iterable[CacheRef],
    cluster_caches: Iterable[CacheRef],
) -> CacheMatch | None:
    annotations = annotations or {}
    if not uri or DISABLE_LOCALMODEL_ANNOTATION in annotations:
        return None
    wanted_group = annotations.get(NODEGROUP_ANNOTATION) or None
    ns_first = sorted((c for c in namespace_caches if c.namespace == namespace), key=lambda c: c.name)
    candidates = [*ns_first, *sorted(cluster_caches, key=lambda c: c.name)]
    for cache in candidates:
        if not match_storage_uri(cache.uri, uri) or len(cache.name) > MAX_LABEL_VALUE:
            continue  # (a name longer than a label value cannot label the service: refused at creation)
        if wanted_group and wanted_group not in cache.node_groups:
            continue
        group = wanted_group or (cache.node_groups[0] if cache.node_groups else "")
        return CacheMatch(cache, group, sub_path(cache.uri, uri))
    return None


def defaulter_metadata(match: CacheMatch | None) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """The labels and annotations KServe's ISVC defaulter sets (None = remove the key)."""
    if match is None:
        labels: dict[str, str | None] = {LOCALMODEL_LABEL: None, LOCALMODEL_NAMESPACE_LABEL: None}
        return labels, {LOCALMODEL_SOURCEURI_ANNOTATION: None, LOCALMODEL_PVC_ANNOTATION: None}
    labels = {LOCALMODEL_LABEL: match.cache.name, LOCALMODEL_NAMESPACE_LABEL: match.cache.namespace}
    annotations: dict[str, str | None] = {
        LOCALMODEL_SOURCEURI_ANNOTATION: match.cache.uri,
        LOCALMODEL_PVC_ANNOTATION: match.pvc_name,
    }
    return labels, annotations


def metadata_patch(
    obj: Mapping[str, Any], labels: Mapping[str, str | None], annotations: Mapping[str, str | None]
) -> dict[str, Any]:
    """A merge patch setting ``labels``/``annotations`` on ``obj`` ({} when it already has them)."""
    m = meta(obj)
    patch: dict[str, Any] = {}
    for field, have, want in (("labels", m.labels, labels), ("annotations", m.annotations, annotations)):


        diff = {k: v for k, v in want.items() if have.get(k) != v and not (v is None and k not in have)}
        if diff:
            patch[field] = diff
    return {"metadata": patch} if patch else {}


#: KServe's predictor implementations in the order ``PredictorSpec.GetImplementations`` lists them
#: (pkg/apis/serving/v1beta1/predictor.go, v0.20.0): the defaulter reads the first one that is set.
PREDICTOR_IMPLEMENTATIONS = ("xgboost", "pytorch", "triton", "sklearn", "tensorflow", "onnx", "pmml", "lightgbm",
                             "paddle", "huggingface", "model")
#: A custom predictor's model URI: the ``STORAGE_URI`` env of its ``kserve-container``
#: (``CustomPredictor.GetStorageUri``, predictor_custom.go) -- the usual vLLM / TGI setup.
PREDICTOR_CONTAINER = "kserve-container"
STORAGE_URI_ENV = "STORAGE_URI"


def isvc_storage_uri(isvc: Mapping[str, Any]) -> str | None:
    """The model URI KServe's defaulter reads from an InferenceService's predictor
    (``GetImplementation().GetStorageUri()``): the ``storageUri`` of the first framework or
    ``model`` spec that is set, else the ``STORAGE_URI`` env of a custom predictor's
    ``kserve-container``. None: KServe reads none either, and then leaves the service's cache
    labels as they are (only a URI that matches no cache removes them). Like KServe's defaulter,
    ``storageUris[]`` and ``storage`` are not considered.
    """
    predictor = (isvc.get("spec") or {}).get("predictor") or {}
    for name in PREDICTOR_IMPLEMENTATIONS:
        impl = predictor.get(name)
        if isinstance(impl, dict):  # the first one set is the implementation, with a URI or not
            uri = impl.get("storageUri")
            return None if uri is None else str(uri)
    containers = [c for c in predictor.get("containers") or [] if isinstance(c, dict)]
    return container_storage_uri(containers) if containers else None


def container_storage_uri(containers: Sequence[Mapping[str, Any]]) -> str | None:
    """``STORAGE_URI`` of the ``kserve-container``. KServe's defaulter names the first container
    so when it is the only one or has no name (``CustomPredictor.Default``) before it reads the
    env, and so does this. An env given by ``valueFrom`` cannot be read here (KServe reads its
    empty ``value``): None, so the labels KServe's own defaulter left stand."""
    def name_of(i: int, c: Mapping[str, Any]) -> str:
        if i == 0 and (len(containers) == 1 or not c.get("name")):
            return PREDICTOR_CONTAINER
        return str(c.get("name") or "")

    for i, container in enumerate(containers):
        if name_of(i, container) != PREDICTOR_CONTAINER:
            continue
        for env in container.get("env") or []:
            if isinstance(env, dict) and env.get("name") == STORAGE_URI_ENV:
                value = env.get("value")
                return str(value) if value and not env.get("valueFrom") else None
        return None
    return None


def llmisvc_model_uri(obj: Mapping[str, Any]) -> str | None:
    """An LLMInferenceService's ``spec.model.uri``."""
    model = (obj.get("spec") or {}).get("model") or {}
    uri = model.get("uri") if isinstance(model, dict) else None
    return str(uri) if uri else None
