"""Typed views of the ``serving.kserve.io/v1alpha1`` objects we read and write.

Field names are KServe v0.20's exactly (its ``pkg/apis/serving/v1alpha1``; docs/crds.md); the fields KServe does not
have (``modelDetails``, ``capacity``, ``modelCounts``, ``conditions``, ...) are optional
additions declared in deploy/crds/. Every class round-trips: ``X.from_dict(d).to_dict()``
keeps unknown keys, so writing back an object never drops what another writer put there.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from modelcache.kube.codec import KEEP, Codec
from modelcache.kube.objects import namespaced_key

GROUP = "serving.kserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# LocalModelNode.status.modelStatus values.
MODEL_STATE_UNKNOWN = ""
MODEL_DOWNLOAD_PENDING = "ModelDownloadPending"
MODEL_DOWNLOADING = "ModelDownloading"
MODEL_DOWNLOADED = "ModelDownloaded"
MODEL_DOWNLOAD_ERROR = "ModelDownloadError"
MODEL_STATES = (MODEL_STATE_UNKNOWN, MODEL_DOWNLOAD_PENDING, MODEL_DOWNLOADING, MODEL_DOWNLOADED, MODEL_DOWNLOAD_ERROR)

# LocalModelCache.status.nodeStatus values.
NODE_STATE_UNKNOWN = ""
NODE_NOT_READY = "NodeNotReady"
NODE_DOWNLOAD_PENDING = "NodeDownloadPending"
NODE_DOWNLOADING = "NodeDownloading"
NODE_DOWNLOADED = "NodeDownloaded"
NODE_DOWNLOAD_ERROR = "NodeDownloadError"
NODE_STATES = (
    NODE_STATE_UNKNOWN, NODE_NOT_READY, NODE_DOWNLOAD_PENDING, NODE_DOWNLOADING, NODE_DOWNLOADED, NODE_DOWNLOAD_ERROR,
)

#: How the cache controller derives a node's state from the agent's model state (§2).
NODE_STATE_FOR_MODEL_STATE = {
    MODEL_DOWNLOAD_PENDING: NODE_DOWNLOAD_PENDING,
    MODEL_DOWNLOADING: NODE_DOWNLOADING,
    MODEL_DOWNLOADED: NODE_DOWNLOADED,
    MODEL_DOWNLOAD_ERROR: NODE_DOWNLOAD_ERROR,
}

# ClusterStorageContainer.spec.workloadType values.
WORKLOAD_INIT_CONTAINER = "initContainer"
WORKLOAD_LOCAL_MODEL_DOWNLOAD_JOB = "localModelDownloadJob"

# Finalizers, labels and annotations (KServe's spelling).
CACHE_FINALIZER = "localmodel.kserve.io/finalizer"
NAMESPACE_CACHE_FINALIZER = "localmodelnamespacecache.kserve.io/finalizer"
LOCALMODEL_LABEL = "internal.serving.kserve.io/localmodel"
LOCALMODEL_NAMESPACE_LABEL = "internal.serving.kserve.io/localmodel-namespace"
LOCALMODEL_SOURCEURI_ANNOTATION = "internal.serving.kserve.io/localmodel-sourceuri"
LOCALMODEL_PVC_ANNOTATION = "internal.serving.kserve.io/localmodel-pvc-name"
DISABLE_LOCALMODEL_ANNOTATION = "serving.kserve.io/disable-localmodel"
NODEGROUP_ANNOTATION = "serving.kserve.io/nodegroup"
#: On a LocalModelNodeGroup: the most bytes the LocalModelNamespaceCaches of any one namespace may
#: hold on each node of the group (a quantity). Ours, not KServe's: without it, one tenant can fill
#: the group's storageLimit on every node with one namespace cache (security review M4).
NAMESPACE_LIMIT_ANNOTATION = "modelcache.io/namespace-storage-limit"
#: The longest label value Kubernetes accepts.
MAX_LABEL_VALUE = 63


def label_value(name: str) -> str:
    """``name`` as a label value: itself when it fits, else its first 50 characters and a hash
    (object names may have 253 characters, label values 63)."""
    if len(name) <= MAX_LABEL_VALUE:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{name[:50].rstrip('-.')}-{digest}"


#: A LocalModelNode carries ``nodegroup.modelcache.io/<group>: "true"`` for each node group its
#: entries name (written by the coordinator with the entries): agents watch only their groups'
#: LocalModelNodes (agent/peering.py), so a status write reaches its group, not the cluster.
NODE_GROUP_LABEL_PREFIX = "nodegroup.modelcache.io/"


def node_group_label(group: str) -> str:
    return NODE_GROUP_LABEL_PREFIX + label_value(group)


def status_key(model_name: str, namespace: str | None = None) -> str:
    """The key of ``modelStatus``: ``modelName``, or ``namespace/modelName`` for a namespace cache."""
    return namespaced_key(namespace, model_name)


# --- shared pieces -------------------------------------------------------------------------


@dataclass
class StorageSpec(Codec):
    key: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class NamespacedName(Codec):
    namespace: str = ""
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Condition(Codec):
    type: str = ""
    status: str = "Unknown"
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class KubeObject(Codec):
    """Base of top-level kinds: ``metadata`` stays a plain dict (we never model it)."""

    KIND: ClassVar[str] = ""
    PLURAL: ClassVar[str] = ""
    NAMESPACED: ClassVar[bool] = False

    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    @property
    def namespace(self) -> str | None:
        return self.metadata.get("namespace")

    @property
    def resource_version(self) -> str | None:
        return self.metadata.get("resourceVersion")

    @property
    def generation(self) -> int:
        return int(self.metadata.get("generation") or 0)

    @property
    def deleting(self) -> bool:
        return bool(self.metadata.get("deletionTimestamp"))

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["apiVersion"] = API_VERSION
        out["kind"] = self.KIND
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None):
        raw = dict(raw or {})
        raw.pop("apiVersion", None)
        raw.pop("kind", None)
        return super().from_dict(raw)


# --- LocalModelCache / LocalModelNamespaceCache ---------------------------------------------


@dataclass
class ModelCopies(Codec):
    available: int = 0
    total: int = 0
    failed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LocalModelCacheSpec(Codec):
    source_model_uri: str = ""
    model_size: str | int = ""
    node_groups: list[str] = field(default_factory=list, metadata=KEEP)
    service_account_name: str | None = None
    storage: StorageSpec | None = None
    image_pull_secrets: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LocalModelCacheStatus(Codec):
    node_status: dict[str, str] = field(default_factory=dict)
    copies: ModelCopies | None = None
    inference_services: list[NamespacedName] = field(default_factory=list)
    llm_inference_services: list[NamespacedName] = field(default_factory=list)
    conditions: list[Condition] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LocalModelCache(KubeObject):
    KIND: ClassVar[str] = "LocalModelCache"
    PLURAL: ClassVar[str] = "localmodelcaches"
    NAMESPACED: ClassVar[bool] = False
    FINALIZER: ClassVar[str] = CACHE_FINALIZER

    spec: LocalModelCacheSpec = field(default_factory=LocalModelCacheSpec)
    status: LocalModelCacheStatus = field(default_factory=LocalModelCacheStatus)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def status_key(self) -> str:
        return status_key(self.name, self.namespace if self.NAMESPACED else None)


@dataclass
class LocalModelNamespaceCache(LocalModelCache):
    """Same spec and status as LocalModelCache; namespaced, used only by ISVCs of its namespace."""

    KIND: ClassVar[str] = "LocalModelNamespaceCache"
    PLURAL: ClassVar[str] = "localmodelnamespacecaches"
    NAMESPACED: ClassVar[bool] = True
    FINALIZER: ClassVar[str] = NAMESPACE_CACHE_FINALIZER


# --- LocalModelNode -------------------------------------------------------------------------


@dataclass
class LocalModelInfo(Codec):
    """One entry of ``spec.localModels``."""

    model_name: str = ""
    source_model_uri: str = ""
    namespace: str | None = None
    node_group: str | None = None
    service_account_name: str | None = None
    storage: StorageSpec | None = None
    image_pull_secrets: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def status_key(self) -> str:
        return status_key(self.model_name, self.namespace)


@dataclass
class LocalModelNodeSpec(Codec):
    local_models: list[LocalModelInfo] = field(default_factory=list, metadata=KEEP)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelDetail(Codec):
    """Our per-model progress (``status.modelDetails[statusKey]``); KServe has no such field."""

    state: str = MODEL_STATE_UNKNOWN
    storage_key: str | None = None
    source_model_uri: str | None = None
    resolved_revision: str | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None
    files_done: int | None = None
    files_total: int | None = None
    rate: int | None = None
    attempts: int | None = None
    message: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    drift: str | None = None
    #: A copy another agent downloaded, counted on its word while it is verified in place
    #: ("Verifying") or while its source cannot be listed to verify it ("Unverified").
    verification: str | None = None
    #: Peer transfer (modelcache.peers): what exactly is fetched, and where its bytes came from.
    listing_digest: str | None = None
    bytes_from_origin: int | None = None
    bytes_from_peers: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class NodeCapacity(Codec):
    total_bytes: int | None = None
    free_bytes: int | None = None
    reserved_bytes: int | None = None
    free: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelCounts(Codec):
    downloaded: int = 0
    downloading: int = 0
    pending: int = 0
    failed: int = 0
    total: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model_status: dict[str, str]) -> ModelCounts:
        states = list(model_status.values())
        return cls(
            downloaded=states.count(MODEL_DOWNLOADED),
            downloading=states.count(MODEL_DOWNLOADING),
            pending=sum(1 for s in states if s in (MODEL_DOWNLOAD_PENDING, MODEL_STATE_UNKNOWN)),
            failed=states.count(MODEL_DOWNLOAD_ERROR),
            total=len(states),
        )


@dataclass
class LocalModelNodeStatus(Codec):
    model_status: dict[str, str] = field(default_factory=dict)
    model_details: dict[str, ModelDetail] = field(default_factory=dict)
    capacity: NodeCapacity | None = None
    model_counts: ModelCounts | None = None
    observed_generation: int | None = None
    last_updated: str | None = None
    conditions: list[Condition] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LocalModelNode(KubeObject):
    KIND: ClassVar[str] = "LocalModelNode"
    PLURAL: ClassVar[str] = "localmodelnodes"

    spec: LocalModelNodeSpec = field(default_factory=LocalModelNodeSpec)
    status: LocalModelNodeStatus = field(default_factory=LocalModelNodeStatus)
    extra: dict[str, Any] = field(default_factory=dict)

    def find(self, model_name: str, namespace: str | None = None) -> LocalModelInfo | None:
        """The spec entry for (modelName, namespace), matched as KServe does (empty == None)."""
        for info in self.spec.local_models:
            if info.model_name == model_name and (info.namespace or None) == (namespace or None):
                return info
        return None


# --- LocalModelNodeGroup --------------------------------------------------------------------


def norm_path(path: str) -> str:
    """A host path as compared with another (``/models/`` and ``/models`` are one directory)."""
    return posixpath.normpath(path) if path else path


def pv_root(pv_spec: Mapping[str, Any]) -> str | None:
    """The host directory a PV spec names (``local.path`` or ``hostPath.path``), else None: where
    a node group's serving pods read models (the agent's root must be the same directory)."""
    path = (pv_spec.get("local") or {}).get("path") or (pv_spec.get("hostPath") or {}).get("path")
    return norm_path(str(path)) if path else None


@dataclass
class LocalModelNodeGroupSpec(Codec):
    storage_limit: str | int = ""
    persistent_volume_spec: dict[str, Any] = field(default_factory=dict, metadata=KEEP)
    persistent_volume_claim_spec: dict[str, Any] = field(default_factory=dict, metadata=KEEP)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def node_selector_terms(self) -> list[dict[str, Any]]:
        """``nodeAffinity.required.nodeSelectorTerms``: membership; empty means no node is a member."""
        required = (self.persistent_volume_spec.get("nodeAffinity") or {}).get("required") or {}
        return list(required.get("nodeSelectorTerms") or [])


@dataclass
class LocalModelNodeGroupStatus(Codec):
    used: str | int | None = None
    available: str | int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LocalModelNodeGroup(KubeObject):
    KIND: ClassVar[str] = "LocalModelNodeGroup"
    PLURAL: ClassVar[str] = "localmodelnodegroups"

    spec: LocalModelNodeGroupSpec = field(default_factory=LocalModelNodeGroupSpec)
    status: LocalModelNodeGroupStatus = field(default_factory=LocalModelNodeGroupStatus)
    extra: dict[str, Any] = field(default_factory=dict)


# --- ClusterStorageContainer ----------------------------------------------------------------


@dataclass
class SupportedUriFormat(Codec):
    prefix: str | None = None
    regex: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StorageContainerSpec(Codec):
    container: dict[str, Any] = field(default_factory=dict, metadata=KEEP)
    supported_uri_formats: list[SupportedUriFormat] = field(default_factory=list, metadata=KEEP)
    workload_type: str | None = None
    supports_multi_model_download: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def effective_workload_type(self) -> str:
        return self.workload_type or WORKLOAD_INIT_CONTAINER


@dataclass
class ClusterStorageContainer(KubeObject):
    KIND: ClassVar[str] = "ClusterStorageContainer"
    PLURAL: ClassVar[str] = "clusterstoragecontainers"

    spec: StorageContainerSpec = field(default_factory=StorageContainerSpec)
    disabled: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


KINDS: dict[str, type[KubeObject]] = {
    cls.KIND: cls
    for cls in (LocalModelCache, LocalModelNamespaceCache, LocalModelNode, LocalModelNodeGroup, ClusterStorageContainer)
}


def from_object(raw: dict[str, Any]) -> KubeObject:
    """Decode any of our kinds by its ``kind``."""
    return KINDS[raw["kind"]].from_dict(raw)
