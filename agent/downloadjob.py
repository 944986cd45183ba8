"""KServe's custom download containers: ClusterStorageContainers of ``workloadType:
localModelDownloadJob``, run the way KServe's node agent runs them, for URIs none of our sources reads.

KServe's agent runs every download as a Job on the node: the container of the first enabled
``localModelDownloadJob`` container whose ``supportedUriFormats`` match the URI (a ``prefix``, else
an unanchored ``regex``, in list order), with ``args: [<uri>, /mnt/models]`` and the model's folder
``models/<storageKey>`` of the node root mounted at ``/mnt/models``. Our agent downloads itself,
with our sources; a URI that only such a container understands (a private scheme, say) gets that
Job, and is then reported like any other model: Downloading while the Job runs, Downloaded (with a
manifest of what the container wrote) once it succeeded, an Error naming the Job when a pod of it
failed (retried with the agent's backoff: a Job still retrying is waited for again, a finished
failed one replaced).

Differences from KServe's Job: the node root is mounted by host path (KServe goes through the
group's download PVC, which we do not create); the Jobs run in their own namespace (``--job-namespace``,
deploy/'s ``modelcache-jobs``, KServe's ``kserve-localmodel-jobs``); the download credentials our
agent would use go to the container as environment variables from a Secret the Job owns (KServe
injects them as environment variables too); file credentials (a GCS key file, an HDFS secret
directory) are not passed. The Job is exactly what deploy/policies/agent-jobs.yaml lets an agent
create (its own node, the one host directory, no privileges, no ServiceAccount token).
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from agent.logs import fields
from modelcache.errors import ModelcacheError
from modelcache.kube.client import SECRETS, Kube, Resource, error_message
from modelcache.kube.objects import meta
from modelcache.kube.types import LocalModelInfo

log = logging.getLogger("agent.downloadjob")

JOBS = Resource("batch", "v1", "jobs", "Job", True)
WORKLOAD_TYPE = "localModelDownloadJob"
MOUNT_PATH = "/mnt/models"
VOLUME = "kserve-pvc-source"  # KServe's name for the volume
JOB_TTL = 3600
FS_GROUP = 1000
#: Environment variables whose values are files on the agent's own disk: useless in another pod.
_FILE_ENV = ("GOOGLE_APPLICATION_CREDENTIALS", "HDFS_SECRET_DIR")


class DownloadJobError(ModelcacheError):
    reason = "DownloadJobFailed"


def supports(container: Mapping[str, Any], uri: str) -> bool:
    """KServe's ``IsStorageUriSupported``: a prefix match, else a regex searched anywhere (Go's
    ``regexp.MatchString``); an invalid regex matches nothing."""
    for fmt in (container.get("spec") or {}).get("supportedUriFormats") or []:
        if fmt.get("prefix"):
            if uri.startswith(str(fmt["prefix"])):
                return True
        elif fmt.get("regex"):
            try:
                if re.search(str(fmt["regex"]), uri):
                    return True
            except re.error:
                continue
    return False


def select(containers: Iterable[Mapping[str, Any]], uri: str) -> Mapping[str, Any] | None:
    """The first enabled download-Job container for ``uri``, in KServe's list order (by name)."""
    for csc in sorted(containers, key=lambda c: meta(c).name):
        if csc.get("disabled") is True or (csc.get("spec") or {}).get("workloadType") != WORKLOAD_TYPE:
            continue
        if supports(csc, uri):
            return csc
    return None


def job_labels(info: LocalModelInfo, node: str) -> dict[str, str]:
    """KServe's labels: the Job of (model, node), plus modelNamespace for a namespace cache."""
    labels = {"model": info.model_name, "node": node}
    if info.namespace:
        labels["modelNamespace"] = info.namespace
    return labels


def secret_keys(names: Iterable[str]) -> dict[str, str]:
    """Environment variable -> the key of the Job's Secret that holds its value. Secret keys allow
    only ``[-._a-zA-Z0-9]``; a variable such as ``<https-host>-headers`` (KServe's, with the host's
    ``:port``) is no valid key, so every value goes under a key of its own making."""
    return {name: f"env-{i}" for i, name in enumerate(sorted(names))}


def job_body(csc: Mapping[str, Any], info: LocalModelInfo, node: str, key: str, host_path: str,
             owner: Mapping[str, Any] | None, env_secret: str | None, env_names: Iterable[str] = ()) -> dict[str, Any]:
    """The Job as deploy/policies/agent-jobs.yaml admits it from an agent (and nothing more)."""
    container = dict((csc.get("spec") or {}).get("container") or {})
    container["args"] = [info.source_model_uri, MOUNT_PATH]
    container["volumeMounts"] = [{"name": VOLUME, "mountPath": MOUNT_PATH, "subPath": f"models/{key}"}]
    if env_secret:
        container["env"] = [*(container.get("env") or []), *(
            {"name": name, "valueFrom": {"secretKeyRef": {"name": env_secret, "key": ref}}}
            for name, ref in secret_keys(env_names).items())]
    container.setdefault("name", "kserve-localmodel-download")
    labels = {**job_labels(info, node), "app.kubernetes.io/managed-by": "modelcache-agent"}
    metadata: dict[str, Any] = {"generateName": f"{info.model_name}-{node}", "labels": labels}
    if owner is not None:
        metadata["ownerReferences"] = _owner_refs(owner)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": {
        "ttlSecondsAfterFinished": JOB_TTL,
        "template": {"metadata": {"labels": labels}, "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": "Never",
            "securityContext": {"fsGroup": FS_GROUP},
            # It talks to no API: no ServiceAccount token in it.
            "automountServiceAccountToken": False,
            "containers": [container],
            "volumes": [{"name": VOLUME, "hostPath": {"path": host_path, "type": "Directory"}}],
        }},
    }}


@dataclass(frozen=True)
class JobState:
    name: str
    succeeded: bool
    failed: bool
    finished: bool
    message: str


def state_of(job: Mapping[str, Any]) -> JobState:
    st = job.get("status") or {}
    conditions = {c.get("type"): c for c in st.get("conditions") or [] if c.get("status") == "True"}
    failed_cond = conditions.get("Failed") or {}
    message = failed_cond.get("message") or failed_cond.get("reason") or ""
    return JobState(name=meta(job).name, succeeded=(st.get("succeeded") or 0) > 0,
                    failed=(st.get("failed") or 0) > 0,
                    finished=bool(conditions.get("Complete") or conditions.get("Failed")), message=message)


class DownloadJobs:
    """Runs download-Job containers for this node. ``containers()``: the ClusterStorageContainers
    (an informer's store); ``owner()``: this node's LocalModelNode (the Jobs' owner, as in KServe)."""

    def __init__(self, kube: Kube, node: str, namespace: str, host_path: str | None,
                 containers: Callable[[], list[dict[str, Any]]], owner: Callable[[], dict[str, Any] | None],
                 poll: float = 1.0) -> None:
        self.kube, self.node, self.namespace, self.host_path = kube, node, namespace, host_path
        self.containers, self.owner, self.poll = containers, owner, poll

    def container_for(self, uri: str) -> Mapping[str, Any] | None:
        return select(self.containers(), uri)

    def _latest(self, info: LocalModelInfo) -> dict[str, Any] | None:
        selector = ",".join(f"{k}={v}" for k, v in job_labels(info, self.node).items())
        items = self.kube.list(JOBS, self.namespace, label_selector=selector).get("items") or []
        live = [j for j in items if not meta(j).deleting]
        return max(live, key=lambda j: meta(j).creation_timestamp, default=None)

    def run(self, info: LocalModelInfo, key: str, folder: Path, cancel: threading.Event,
            env: Mapping[str, str]) -> str:
        """Make sure a Job downloads the model into ``folder`` and wait for it; returns the Job's
        name. Raises DownloadJobError when a pod of it failed, ModelcacheError when cancelled."""
        csc = self.container_for(info.source_model_uri)
        if csc is None:
            raise DownloadJobError(f"{info.status_key}: no ClusterStorageContainer of workloadType {WORKLOAD_TYPE} "
                                   "matches its URI any more")
        if not self.host_path:
            raise DownloadJobError(f"{info.status_key}: the download container needs the model root's host path "
                                   "to mount (set --host-path, or run the agent in its DaemonSet)")
        job = self._latest(info)
        if job is not None and state_of(job).finished and not state_of(job).succeeded:
            self._delete(state_of(job).name)  # a finished failed Job: this attempt is a new one
            job = None
        elif job is not None and state_of(job).succeeded and not _has_files(folder):
            job = None  # its files are gone since (KServe: a folder absent gets a new Job)
        if job is None:
            _make_folder(folder, info.status_key)
            job = self._create(csc, info, key, env)
        name = state_of(job).name
        while True:
            st = state_of(job)
            if st.succeeded:
                return name
            if st.failed:
                via = meta(csc).name
                raise DownloadJobError(f"download Job {self.namespace}/{name} (ClusterStorageContainer {via}) failed"
                                       f"{': ' + st.message if st.message else ''}; see its pod's logs")
            if cancel.wait(self.poll):
                self._delete(name)
                raise ModelcacheError(f"download Job {self.namespace}/{name} stopped: the model left the spec")
            got = self.kube.get_or_none(JOBS, name, self.namespace)
            if got is None:
                raise DownloadJobError(f"download Job {self.namespace}/{name} was deleted before it finished")
            job = got

    def _create(self, csc: Mapping[str, Any], info: LocalModelInfo, key: str, env: Mapping[str, str]) -> dict[str, Any]:
        # KServe's generateName is <model>-<node> (no dash before the suffix); the name is chosen
        # here so that the Job can name its credentials Secret before that exists.
        name = f"{info.model_name}-{self.node}"[:57] + secrets.token_hex(3)[:5]
        passed = {k: v for k, v in env.items() if k not in _FILE_ENV}
        body = job_body(csc, info, self.node, key, str(self.host_path), self.owner(), name if passed else None,
                        passed)
        body["metadata"].pop("generateName")  # an edit of the body we write: the dict, not a view
        body["metadata"]["name"] = name
        job = self.kube.create(JOBS, body, self.namespace)
        if passed:
            # The download's credentials, as KServe injects them into its Job: environment variables,
            # here from a Secret owned by the Job (the garbage collector deletes it with the Job). Its
            # pod waits for it (CreateContainerConfigError) if it starts first.
            secret = {"metadata": {"name": name, "labels": job_labels(info, self.node), "ownerReferences": [{
                          "apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": meta(job).uid,
                          "controller": True}]},
                      "type": "Opaque", "stringData": {ref: passed[env] for env, ref in secret_keys(passed).items()}}
            try:
                self.kube.create(SECRETS, secret, self.namespace)
            except ApiException as exc:
                self._delete(name)  # a Job whose Secret never comes would wait for ever
                raise DownloadJobError(f"download Job {self.namespace}/{name}: its credentials Secret was refused "
                                       f"({error_message(exc)}); the Job is deleted") from None
        log.info("download Job created", extra=fields(job=name, namespace=self.namespace, storage_key=key,
                                                      container=meta(csc).name))
        return job

    def _delete(self, name: str) -> None:
        """The Job, its pods and its Secret (dependents: background propagation)."""
        try:
            self.kube.delete(JOBS, name, self.namespace, propagation="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise


def _make_folder(folder: Path, what: str) -> None:
    """The folder the container mounts (subPath ``models/<storageKey>``), made before its Job: a
    subPath that does not exist the kubelet makes as root, with the mode of the volume's root
    (0755), and the container's user cannot write it (on a real node, our image as the container:
    "Permission denied"). Made by the agent's user, group-writable for the pod's fsGroup."""
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        return
    except OSError as exc:
        raise DownloadJobError(f"{what}: cannot make {folder} for the download container: {exc.strerror}") from None
    folder.chmod(0o775)  # not left to the agent's umask


def _has_files(folder: Path) -> bool:
    try:
        return any(p.is_file() for p in folder.rglob("*"))
    except OSError:
        return False


def _owner_refs(owner: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    if owner is None:
        return []
    om = meta(owner)
    return [{"apiVersion": owner.get("apiVersion", "serving.kserve.io/v1alpha1"),
             "kind": owner.get("kind", "LocalModelNode"), "name": om.name, "uid": om.uid,
             "controller": True, "blockOwnerDeletion": False}]
