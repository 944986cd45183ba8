"""Before the switch (``modelcache migrate``): list every cache's source as the agent will list it.

After the switch the agent verifies each copy KServe downloaded against its source's listing; a
source it cannot list leaves that copy served unverified, and no new node gets one. So migrate
lists each cache's URI first, with the credentials the agent will build for it (this module uses
the agent's own ``Credentials``: the same Secret and ServiceAccount rules, KServe's ``credentials``
block, the agent's plain environment), and names each one that fails and why.

What cannot be tried from the machine running migrate is said, not guessed: a keyless cache on a
cloud's storage is read with the agent pod's workload identity (migrate's ``identity`` check says
what to bind), and the listing runs from here, not from a node (a private endpoint reachable only
in the cluster fails here).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.credentials import Credentials, KubeSecretReader
from modelcache.errors import ModelcacheError
from modelcache.kube.migrate import IDENTITY_KINDS, Facts, SourceCheck, cache_name, keyless
from modelcache.kube.types import LocalModelInfo, StorageSpec
from modelcache.kube.views import CacheView
from modelcache.pull import list_source
from modelcache.runtime.redact import redact_uri, scrub_urls
from modelcache.sources.base import open_source
from modelcache.sources.uri import AzureBlobLocation, Location, parse_uri

#: Seconds one listing may take before it counts as failed (the agent would retry; here we report).
LIST_TIMEOUT = 30.0
#: Kinds that read the local file system or a claim on the node: nothing to list from here.
LOCAL_KINDS = ("pvc", "local")


@dataclass
class _Result:
    check: SourceCheck | None = None


def check_sources(kube: Any, facts: Facts, base_env: Mapping[str, str] | None = None,
                  timeout: float = LIST_TIMEOUT) -> list[SourceCheck]:
    """One SourceCheck per cache (cluster and namespace caches), listed in parallel."""
    results = [_Result() for _ in facts.caches]
    threads = []
    for i, cache in enumerate(facts.caches):
        t = threading.Thread(target=_run, args=(kube, facts, cache, dict(base_env or {}), results[i]),
                             name="migrate-list", daemon=True)  # a hung listing must not keep migrate alive
        t.start()
        threads.append(t)
    out = []
    for cache, thread, result in zip(facts.caches, threads, results, strict=True):
        thread.join(timeout)
        uri = redact_uri(CacheView(cache).source_model_uri)
        out.append(result.check or SourceCheck(cache_name(cache), uri, "failed",
                                               f"no answer within {timeout:.0f} s"))
    return out


def _run(kube: Any, facts: Facts, cache: dict[str, Any], base_env: dict[str, str], out: _Result) -> None:
    try:
        out.check = check_one(kube, facts, cache, base_env)
    except Exception as exc:  # reported as the cache's failure, never a traceback of migrate
        uri = redact_uri(CacheView(cache).source_model_uri)
        out.check = SourceCheck(cache_name(cache), uri, "failed", _one_line(exc))


def check_one(kube: Any, facts: Facts, cache: dict[str, Any], base_env: dict[str, str]) -> SourceCheck:
    view = CacheView(cache)
    spec, m, raw = view.spec, view.meta, view.source_model_uri
    name, uri = cache_name(cache), redact_uri(raw)
    try:
        location = parse_uri(raw)
    except ModelcacheError as exc:
        return SourceCheck(name, uri, "refused", _one_line(exc))
    if location.kind in LOCAL_KINDS:
        return SourceCheck(name, uri, "skipped", "read on the node")
    if keyless(cache) and _ambient(location):
        return SourceCheck(name, uri, "keyless", "the agent's own identity")
    storage = spec.get("storage") or None
    info = LocalModelInfo(model_name=m.name, source_model_uri=raw,
                          namespace=m.namespace,
                          service_account_name=spec.get("serviceAccountName") or None,
                          storage=StorageSpec.from_dict(storage) if storage else None)
    namespace = _credentials_namespace(facts, cache)
    reader = KubeSecretReader(kube, namespace, f"{facts.kserve_namespace}/inferenceservice-config")
    try:
        with Credentials(reader, base_env).settings_for(info) as settings, open_source(location, settings) as source:
            files = list_source(source, settings)
    except ModelcacheError as exc:
        where = "" if namespace == facts.credentials_namespace else \
            f" (credentials read in {namespace}: not copied yet)"
        return SourceCheck(name, uri, "failed", f"{exc.reason}: {_one_line(exc)}{where}")
    return SourceCheck(name, uri, "ok", files=len(files), bytes=sum(f.size or 0 for f in files))


def _ambient(location: Location) -> bool:
    """A keyless download of this location uses the identity of the pod that runs it (a cloud's
    storage without a SAS in the URI; HDFS, whose namenode and Kerberos come from the agent; an
    OCI registry, whose docker config is a file in the agent's pod)."""
    if isinstance(location, AzureBlobLocation) and location.sas:
        return False
    return location.kind in IDENTITY_KINDS or location.kind in ("hdfs", "oci")


def _credentials_namespace(facts: Facts, cache: dict[str, Any]) -> str:
    """Ours, unless what the cache names is only in KServe's job namespace yet (migrate's
    ``credentials`` step copies it from there, unchanged)."""
    spec = cache.get("spec") or {}
    storage = spec.get("storage") or {}
    if storage.get("key") is not None or storage.get("parameters"):
        ref = ("secret", facts.storage_secret)
    elif spec.get("serviceAccountName"):
        ref = ("serviceaccount", str(spec["serviceAccountName"]))
    else:
        return facts.credentials_namespace
    ours = (ref[0], facts.credentials_namespace, ref[1])
    theirs = (ref[0], facts.job_namespace, ref[1])
    if not facts.present.get(ours) and facts.present.get(theirs):
        return facts.job_namespace
    return facts.credentials_namespace


def _one_line(exc: BaseException) -> str:
    return scrub_urls(" ".join(str(exc).split()))[:300] or type(exc).__name__
