"""Finding the API server and thin, dict-in dict-out helpers over the official client.

Config is found the standard way: an explicit kubeconfig path (``--kubeconfig``), else, in a pod
(``KUBERNETES_SERVICE_HOST``/``_PORT`` set by the kubelet), the mounted service account, else
``KUBECONFIG`` / ``~/.kube/config`` (the client library reads those variables itself). Every
call passes ``_preload_content=False`` and decodes the JSON body: objects stay plain dicts with
their exact wire keys (no lossy model round-trip), and kubernetes>=37's
``CustomObjectsApi.create_*``, which deserializes only a 201, cannot turn a 200 into ``None``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.incluster_config import InClusterConfigLoader

from modelcache.kube.objects import meta
from modelcache.runtime.startup import StartupError

#: Where the kubelet mounts a pod's service account: token, ca.crt, namespace.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: How often the (projected, rotating) token file is read again; client-go re-reads every minute too.
TOKEN_REFRESH = datetime.timedelta(minutes=1)

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class Resource:
    """What the helpers need to address one kind: group/version/plural and scope.

    ``api`` picks the official API class: ``custom`` (CustomObjectsApi, any group), ``core``
    (CoreV1Api) or ``coordination`` (CoordinationV1Api); ``snake`` is the typed API's method
    stem (``persistent_volume_claim``) and ``model`` its body class for create/replace.
    """

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    api: str = "custom"
    snake: str = ""
    model: str = ""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


def _core(plural: str, kind: str, namespaced: bool, snake: str, model: str = "") -> Resource:
    return Resource("", "v1", plural, kind, namespaced, "core", snake, model or f"V1{kind}")


KSERVE = "serving.kserve.io"
LOCAL_MODEL_CACHES = Resource(KSERVE, "v1alpha1", "localmodelcaches", "LocalModelCache", False)
LOCAL_MODEL_NAMESPACE_CACHES = Resource(
    KSERVE, "v1alpha1", "localmodelnamespacecaches", "LocalModelNamespaceCache", True
)
LOCAL_MODEL_NODES = Resource(KSERVE, "v1alpha1", "localmodelnodes", "LocalModelNode", False)
LOCAL_MODEL_NODE_GROUPS = Resource(KSERVE, "v1alpha1", "localmodelnodegroups", "LocalModelNodeGroup", False)
CLUSTER_STORAGE_CONTAINERS = Resource(KSERVE, "v1alpha1", "clusterstoragecontainers", "ClusterStorageContainer", False)
INFERENCE_SERVICES = Resource(KSERVE, "v1beta1", "inferenceservices", "InferenceService", True)
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease", True, "coordination", "lease", "V1Lease")
CUSTOM_RESOURCE_DEFINITIONS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions",
                                       "CustomResourceDefinition", False)
NODES = _core("nodes", "Node", False, "node")
PODS = _core("pods", "Pod", True, "pod")
NAMESPACES = _core("namespaces", "Namespace", False, "namespace")
PERSISTENT_VOLUMES = _core("persistentvolumes", "PersistentVolume", False, "persistent_volume")
PERSISTENT_VOLUME_CLAIMS = _core("persistentvolumeclaims", "PersistentVolumeClaim", True, "persistent_volume_claim")
SECRETS = _core("secrets", "Secret", True, "secret")
SERVICE_ACCOUNTS = _core("serviceaccounts", "ServiceAccount", True, "service_account")
CONFIG_MAPS = _core("configmaps", "ConfigMap", True, "config_map")
EVENTS = _core("events", "Event", True, "event", "CoreV1Event")

_TYPED_APIS: dict[str, Callable[[client.ApiClient], Any]] = {
    "core": client.CoreV1Api,
    "coordination": client.CoordinationV1Api,
}


class KubeConfigError(StartupError):
    """No usable cluster configuration; the message is one line naming the file and the fix."""


class _ServiceAccountLoader(InClusterConfigLoader):
    """The client library's in-cluster loader, reading the token as client-go does: surrounding
    whitespace stripped (a token file written by hand often ends in a newline, which would
    otherwise go into the Authorization header and fail every request), re-read every
    ``refresh`` so a rotated projected token is picked up."""

    def __init__(self, sa_dir: Path, environ: Mapping[str, str], refresh: datetime.timedelta) -> None:
        super().__init__(str(sa_dir / "token"), str(sa_dir / "ca.crt"), environ=environ)
        self._token_refresh_period = refresh

    def _read_token_file(self) -> None:
        with open(self._token_filename) as f:
            token = f.read().strip()
        if not token:
            raise config.ConfigException(f"the service account token {self._token_filename} is empty")
        self.token = "Bearer " + token
        self.token_expires_at = datetime.datetime.now() + self._token_refresh_period


def in_pod(environ: Mapping[str, str] | None = None) -> bool:
    """True where the kubelet set the API server's address, as it does in every pod."""
    env = os.environ if environ is None else environ
    return bool(env.get("KUBERNETES_SERVICE_HOST") and env.get("KUBERNETES_SERVICE_PORT"))


def in_cluster_api_client(sa_dir: Path | None = None, environ: Mapping[str, str] | None = None,
                          refresh: datetime.timedelta = TOKEN_REFRESH) -> client.ApiClient:
    """An ApiClient from the pod's service account (https://KUBERNETES_SERVICE_HOST:PORT)."""
    env = os.environ if environ is None else environ
    sa_dir = SERVICE_ACCOUNT_DIR if sa_dir is None else sa_dir
    for name in ("token", "ca.crt"):
        path = sa_dir / name
        if not path.is_file() or path.stat().st_size == 0:
            raise KubeConfigError(
                f"in-cluster config: {path} is missing or empty: run with the pod's service account token "
                "mounted (automountServiceAccountToken: true) or pass --kubeconfig")
    cfg = client.Configuration()
    try:
        _ServiceAccountLoader(sa_dir, env, refresh).load_and_set(cfg)
    except config.ConfigException as exc:
        raise KubeConfigError(f"in-cluster config: {exc}") from None
    return client.ApiClient(cfg)


def in_cluster_namespace(sa_dir: Path | None = None) -> str | None:
    """The pod's namespace as mounted with its service account; None outside a pod."""
    try:
        return ((SERVICE_ACCOUNT_DIR if sa_dir is None else sa_dir) / "namespace").read_text().strip() or None
    except OSError:
        return None


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> client.ApiClient:
    """An ApiClient for the cluster, found the way kubectl and controller-runtime find it.

    Processes pass their ``--kubeconfig`` flag (which defaults to ``$KUBECONFIG``) here. A file that
    cannot be read or is not a kubeconfig, or (in a pod) a broken service account mount, is a one-line
    ``KubeConfigError`` naming the flag or file that fixes it, never a silent fall-back to
    ``~/.kube/config``.
    """
    if kubeconfig:
        try:
            with open(kubeconfig, "rb"):
                pass
        except OSError as exc:
            raise KubeConfigError(f"--kubeconfig {kubeconfig}: cannot read it ({exc.strerror or exc}); point "
                                  "--kubeconfig (or KUBECONFIG) at a readable kubeconfig file") from None
        try:
            return config.new_client_from_config(config_file=kubeconfig, context=context)
        except Exception as exc:  # yaml errors, ConfigException, a missing cert file it names, ...
            raise KubeConfigError(f"--kubeconfig {kubeconfig}: not a usable kubeconfig ({_first_line(exc)}); "
                                  "fix the file or point --kubeconfig (or KUBECONFIG) at another") from None
    if in_pod():
        return in_cluster_api_client()
    # The library itself falls back to KUBECONFIG, then ~/.kube/config (read when it is imported).
    try:
        return config.new_client_from_config(context=context)
    except Exception as exc:
        where = os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise KubeConfigError(f"no cluster to talk to: not in a pod (KUBERNETES_SERVICE_HOST unset) and {where} is "
                              f"not usable ({_first_line(exc)}); pass --kubeconfig (or set KUBECONFIG)") from None


def config_source(kubeconfig: str | None) -> str:
    """Where ``load_api_client(kubeconfig)`` found the cluster, as a message names it."""
    if kubeconfig:
        return f"--kubeconfig {kubeconfig}"
    if in_pod():
        return "the pod's service account (in-cluster config)"
    return f"{os.environ.get('KUBECONFIG') or '~/.kube/config'} (no --kubeconfig given)"


class _Unreachable(Exception):
    """Nothing answered at the API server's address (a reason on one line)."""


def _probe(api_client: client.ApiClient, source: str, timeout: float) -> None:
    host = api_client.configuration.host
    try:
        # Not decoded: any answer will do, and a strict model would refuse a partial one.
        raw: Any = client.VersionApi(api_client).get_code(_request_timeout=timeout, _preload_content=False)
        raw.release_conn()  # the raw response (not decoded), whatever the client's types say
    except ApiException as exc:
        if exc.status == 401:
            raise KubeConfigError(
                f"{source}: the API server {host} refused its credentials (401 Unauthorized: the token or client "
                "certificate is not valid there, or expired); fix the credentials or point --kubeconfig "
                "(or KUBECONFIG) at another") from None
        # Any other answer (403 where /version is not public, 5xx) means it is there: carry on.
    except Exception as exc:  # urllib3's MaxRetryError, SSLError, a timeout: nothing answered
        reason = getattr(exc, "reason", None) or exc
        text = " ".join(str(reason).split())
        for known in ("Connection refused", "Name or service not known", "certificate verify failed",
                      "No route to host", "timed out", "Network is unreachable"):
            if known.lower() in text.lower():
                text = known.lower()
                break
        if text == "certificate verify failed":  # no wait makes a wrong CA right
            raise KubeConfigError(f"{source}: the API server {host} is not trusted ({text}); check the certificate "
                                  "authority in it") from None
        raise _Unreachable(text[:200]) from None


def check_api_server(api_client: client.ApiClient, source: str, timeout: float = 15.0, patience: float = 0.0,
                     stop: threading.Event | None = None) -> bool:
    """``GET /version`` at start: a kubeconfig naming a server that is not there, or credentials
    the server refuses, is one line naming the file now (``KubeConfigError``, exit 2) rather than
    a traceback, or a minute of silent retries, later.

    ``patience``: seconds an unreachable server is waited for, asked every 2 s (a pod on a node
    that is still starting may not reach the API server's Service yet; a restart loop's backoff
    would only add minutes). False if ``stop`` was set while waiting."""
    host = api_client.configuration.host
    deadline = time.monotonic() + patience
    pool_log = logging.getLogger("urllib3.connectionpool")
    level = pool_log.level
    pool_log.setLevel(logging.ERROR)  # its retry warnings would bury the one line below
    try:
        while True:
            try:
                _probe(api_client, source, timeout)
                return True
            except _Unreachable as exc:
                if time.monotonic() >= deadline:
                    waited = f", waited {patience:.0f} s" if patience else ""
                    raise KubeConfigError(
                        f"{source}: cannot reach the API server {host} ({exc}{waited}); check the server address "
                        "in it, or that the API server is up and reachable from here") from None
                logging.getLogger(__name__).warning("cannot reach the API server %s (%s): retrying", host, exc)
                if stop is not None and stop.wait(2.0):
                    return False
                if stop is None:
                    time.sleep(2.0)
    finally:
        pool_log.setLevel(level)


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


def is_status(exc: BaseException, *codes: int) -> bool:
    return isinstance(exc, ApiException) and exc.status in codes


def not_found(exc: BaseException) -> bool:
    return is_status(exc, 404)


def conflict(exc: BaseException) -> bool:
    return is_status(exc, 409)


def gone(exc: BaseException) -> bool:
    return is_status(exc, 410)


def error_message(exc: BaseException) -> str:
    """The API's one-line ``message`` from a Status body, else the exception's reason."""
    if isinstance(exc, ApiException):
        try:
            return str(json.loads(exc.body or "{}").get("message") or exc.reason)
        except (ValueError, AttributeError):
            return str(exc.reason)
    return str(exc)


#: The Accept header asking for an object's metadata only (the API server's PartialObjectMetadata).
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


def _decode(resp: Any) -> Any:
    try:
        data = resp.data
    finally:
        resp.release_conn()
    return json.loads(data) if data else {}


def count_requests(api_client: client.ApiClient, count: Callable[[str], None]) -> None:
    """Call ``count(verb)`` for every HTTP request ``api_client`` sends (``WATCH`` for a watch's GET):
    what a process costs the API server, for metrics and benchmarks."""
    pool = api_client.rest_client.pool_manager
    send = pool.request

    def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        count("WATCH" if method == "GET" and "watch=" in url else method)
        return send(method, url, *args, **kwargs)

    # Wrapping the pool's bound method is the one hook the kubernetes client leaves for counting.
    pool.request = request  # type: ignore[method-assign]


class Kube:
    """Generic CRUD on dicts for any :class:`Resource`; one instance per ApiClient."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.custom = client.CustomObjectsApi(api_client)
        self._typed = {name: factory(api_client) for name, factory in _TYPED_APIS.items()}

    # -- dispatch ---------------------------------------------------------------------------
    def _typed_call(self, res: Resource, verb: str, namespace: str | None, suffix: str = "", **kw: Any) -> Any:
        api = self._typed[res.api]
        if res.namespaced and namespace is None and verb == "list":
            fn = getattr(api, f"list_{res.snake}_for_all_namespaces")
        elif res.namespaced:
            fn = getattr(api, f"{verb}_namespaced_{res.snake}{suffix}")
            kw["namespace"] = namespace
        else:
            fn = getattr(api, f"{verb}_{res.snake}{suffix}")
        return fn(_preload_content=False, **kw)

    def _custom_call(self, res: Resource, verb: str, namespace: str | None, suffix: str = "", **kw: Any) -> Any:
        if res.namespaced and namespace is None and verb == "list":
            name = "list_custom_object_for_all_namespaces"
        elif res.namespaced:
            name = f"{verb}_namespaced_custom_object{suffix}"
            kw["namespace"] = namespace
        else:
            name = f"{verb}_cluster_custom_object{suffix}"
        # The all-namespaces list names its plural parameter differently from every other method.
        plural_arg = "resource_plural" if name == "list_custom_object_for_all_namespaces" else "plural"
        kw[plural_arg] = res.plural
        return getattr(self.custom, name)(group=res.group, version=res.version, _preload_content=False, **kw)

    def _call(self, res: Resource, verb: str, namespace: str | None, suffix: str = "", **kw: Any) -> Any:
        if res.api == "custom":
            return self._custom_call(res, verb, namespace, suffix, **kw)
        if verb == "get":
            verb = "read"
        model = getattr(client, res.model)
        if verb in ("create", "replace") and "body" in kw and hasattr(model, "model_validate"):
            # kubernetes>=37 (pydantic models) wants the typed body; older clients send the dict as is.
            kw["body"] = model.model_validate(kw["body"])
        return self._typed_call(res, verb, namespace, suffix, **kw)

    # -- verbs ------------------------------------------------------------------------------
    def get(self, res: Resource, name: str, namespace: str | None = None) -> dict[str, Any]:
        return _decode(self._call(res, "get", namespace, name=name))

    def get_or_none(self, res: Resource, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return self.get(res, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, res: Resource, namespace: str | None = None, **query: Any) -> dict[str, Any]:
        """The raw List (``items`` + ``metadata.resourceVersion``); query: label_selector, limit, ..."""
        return _decode(self._call(res, "list", namespace, **query))

    def create(self, res: Resource, body: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        body = {"apiVersion": res.api_version, "kind": res.kind, **body}
        return _decode(self._call(res, "create", namespace, body=body))

    def replace(self, res: Resource, body: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """PUT; ``body.metadata.resourceVersion`` makes it a compare-and-swap (409 when stale)."""
        body = {"apiVersion": res.api_version, "kind": res.kind, **body}
        name = meta(body).name
        return _decode(self._call(res, "replace", namespace, name=name, body=body))

    def patch(
        self, res: Resource, name: str, patch: Any, namespace: str | None = None, content_type: str = MERGE_PATCH,
        metadata_only: bool = False,
    ) -> dict[str, Any]:
        """``metadata_only``: the server answers with the object's metadata alone (a
        PartialObjectMetadata), not the whole object: a Node carries its images, addresses and
        capacity (23 KB each in bench/coordinator_scale.py), which a label patch does not need
        back, and which the API server encodes and we decode for every patch."""
        kw: dict[str, Any] = {"_headers": {"Accept": METADATA_ONLY}} if metadata_only else {}
        return _decode(self._call(res, "patch", namespace, name=name, body=patch, _content_type=content_type, **kw))

    def patch_status(
        self, res: Resource, name: str, patch: Any, namespace: str | None = None, content_type: str = MERGE_PATCH
    ) -> dict[str, Any]:
        return _decode(
            self._call(res, "patch", namespace, "_status", name=name, body=patch, _content_type=content_type)
        )

    def replace_status(self, res: Resource, body: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """PUT to the status subresource (spec changes in ``body`` are ignored by the server)."""
        body = {"apiVersion": res.api_version, "kind": res.kind, **body}
        name = meta(body).name
        return _decode(self._call(res, "replace", namespace, "_status", name=name, body=body))

    def delete(self, res: Resource, name: str, namespace: str | None = None, propagation: str | None = None,
               grace_period: int | None = None) -> bool:
        """Delete; False if it was already gone. ``grace_period=0`` removes a pod at once (what its
        kubelet does once the containers stopped)."""
        kw: dict[str, Any] = {"name": name}
        if propagation:
            kw["propagation_policy"] = propagation
        if grace_period is not None:
            kw["grace_period_seconds"] = grace_period
        try:
            _decode(self._call(res, "delete", namespace, **kw))
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def path(self, res: Resource, namespace: str | None = None) -> str:
        """The collection's URL path (``namespace`` None: all namespaces)."""
        base = f"/apis/{res.group}/{res.version}" if res.group else f"/api/{res.version}"
        ns = f"/namespaces/{namespace}" if res.namespaced and namespace else ""
        return f"{base}{ns}/{res.plural}"

    def stream_response(self, res: Resource, namespace: str | None = None, query: Mapping[str, Any] | None = None,
                        timeout: Any = None) -> Any:
        """A raw streaming GET of the collection with the query parameters as the API names them
        (the generated methods refuse parameters they do not know, such as ``sendInitialEvents`` on
        custom objects); the caller reads and closes the urllib3 response. Non-2xx raises."""
        params = [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in (query or {}).items()]
        request = self.api_client.param_serialize("GET", self.path(res, namespace), query_params=params,
                                                  header_params={"Accept": "application/json"},
                                                  auth_settings=["BearerToken"])
        resp = self.api_client.call_api(*request, _request_timeout=timeout)
        if not 200 <= resp.status <= 299:
            resp.read()
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return resp.response

    def watch_response(self, res: Resource, namespace: str | None = None, **query: Any) -> Any:
        """A raw streaming watch response (one JSON event per line); the caller closes it."""
        return self._call(res, "list", namespace, watch=True, **query)
