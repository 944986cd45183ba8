"""What the S3, GCS and Azure Blob sources share: folder-bounded listing, parallel per-object
metadata calls, quiet SDK logs (their bytes go through ``httpread``, as every HTTP backend's).

Object stores have no folders, only keys. ``s3://b/model`` must mean the object ``model`` or
the keys under ``model/`` -- never ``model_v2/...`` (KServe's raw-prefix bug). Keys ending in
``/`` are folder markers made by consoles and tools; real zero-byte files are kept.
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from modelcache.errors import InvalidURIError, NotFoundError
from modelcache.sources.base import safe_relpath

#: HTTP connections each source keeps pooled. Above the engine's usual worker counts: a pool
#: smaller than the number of concurrent reads makes urllib3 discard connections (and warn).
CONNECTION_POOL = 64

_QUERY = re.compile(r"\?[^\s\"']*")


class _RedactQueries(logging.Filter):
    """urllib3 logs each request line at DEBUG with its query string, where a SAS signature or
    a presigned URL's signature lives; keep the line, drop the query."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, str) and "?" in a for a in record.args):
            record.args = tuple(_QUERY.sub("?<redacted>", a) if isinstance(a, str) else a for a in record.args)
        return True


def quiet_sdk_logs() -> None:
    """No secret in any log, whatever the root level: botocore's DEBUG records print request
    headers (the session token, X-Amz-Security-Token) and canonical requests, so botocore and
    boto3 log from INFO up; urllib3's request lines lose their query strings."""
    for name in ("botocore", "boto3", "s3transfer"):
        logger = logging.getLogger(name)
        if logger.level < logging.INFO:
            logger.setLevel(logging.INFO)
    pool_logger = logging.getLogger("urllib3.connectionpool")
    if not any(isinstance(f, _RedactQueries) for f in pool_logger.filters):
        pool_logger.addFilter(_RedactQueries())


T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Scope:
    """What a URI's prefix selects: the keys under ``folder`` (a ``/``-terminated prefix, or ""
    for the whole bucket) and, if the folder is empty, possibly the single object ``single``."""

    folder: str
    single: str | None


def scope_of(prefix: str) -> Scope:
    if not prefix:
        return Scope(folder="", single=None)
    if prefix.endswith("/"):
        return Scope(folder=prefix, single=None)
    return Scope(folder=prefix + "/", single=prefix)


def relpath_in(scope: Scope, key: str, where: str) -> str | None:
    """The model-relative path of ``key``, or None for a folder marker."""
    if key.endswith("/"):
        return None
    if not key.startswith(scope.folder):  # defensive: the listing was bounded by the folder
        return None
    return safe_relpath(key[len(scope.folder) :], where)


def single_object_path(key: str, where: str) -> str:
    """A single-object URI lands in the model folder under the object's basename (KServe)."""
    return safe_relpath(posixpath.basename(key), where)


def check_unique(paths: Iterable[str], where: str) -> None:
    """Two keys that normalise to one path (``a//b`` and ``a/b``) would overwrite each other."""
    seen: set[str] = set()
    for p in paths:
        if p in seen:
            raise InvalidURIError(f"{where}: two objects map to the same file path {p!r}; rename one of them")
        seen.add(p)


def nothing_found(display: str, backend: str) -> NotFoundError:
    return NotFoundError(
        f"no model found at {display}: the {backend} prefix has no objects (neither an object of that name "
        "nor a folder under it); check the path and that the upload finished"
    )


def parallel_map(fn: Callable[[T], R], items: list[T], workers: int = 8) -> list[R]:
    """Per-object metadata calls (HEAD) for a listing, a few at a time, in input order."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="head") as pool:
        return list(pool.map(fn, items))
