"""Informer: a local, always-current copy of one kind, and change notifications.

Protocol (as client-go's reflector): LIST, then WATCH from the list's ``resourceVersion`` with
bookmarks. The LIST is streamed where the API server can (client-go's WatchList: a watch with
``sendInitialEvents=true`` delivers every object as an event from the watch cache, then a bookmark
marked ``k8s.io/initial-events-end``): one object in memory at a time, whatever the collection's
size, and no etcd read. Elsewhere it is paged, the first time from the watch cache
(``resourceVersion=0``, which the server answers whole). When the watch ends (server timeout,
dropped connection) it is re-opened from the last resourceVersion seen, so nothing is missed and
nothing is replayed. When the server answers that it cannot serve a watch from that version (``410
Gone``: compacted away; ``Too large resource version``: an etcd restore or a lagging replica put it
in the server's future; any other ERROR event or error status) the informer relists instead, and the
LIST is diffed against the cache so handlers see exactly the adds, updates and deletes that happened
meanwhile. Only failures without an answer (connection refused or reset, a timeout, 429) are resumed
from the same version, and after a few of those in a row it relists too.

A version in the server's future is not always answered with an error: the real API server's watch
cache serves a plain watch from it by sending nothing at all (checked on v1.37), and once the
restored store's ordinary writes (leases, events) carry its version past ours, events flow again
and everything written in between is never sent. So the informer never trusts a resume blindly
after the server's store may have changed:
- after the server could not be reached (connection refused, a connect timeout: it restarted,
  the way every etcd restore goes), the next successful connection relists;
- before every watch it re-opens (the server's timeout ends each one: that is the periodic check,
  every ``watch_timeout`` seconds) it asks for the server's current version (a list of one item);
  if that is older than the version it has seen, the store went back in time and it relists.
"""

from __future__ import annotations

import builtins
import copy
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kubernetes.client.exceptions import ApiException

from modelcache.kube.client import Kube, Resource, error_message
from modelcache.kube.objects import list_meta, meta

log = logging.getLogger(__name__)

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"

#: handler(event_type, new_or_deleted_object, old_object_or_None). The objects are the cache's
#: own: handlers read them and must not mutate them (copy first).
Handler = Callable[[str, dict[str, Any], dict[str, Any] | None], None]
IndexFunc = Callable[[dict[str, Any]], Iterable[str]]
#: What is kept of each object before it is stored (client-go's TransformFunc): the fields a
#: reader uses. It may change the object it gets and returns what to store.
Transform = Callable[[dict[str, Any]], dict[str, Any]]


def drop_managed_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """The default transform: ``metadata.managedFields`` (server-side apply's bookkeeping, often
    the largest part of an object) is read by nobody here."""
    (obj.get("metadata") or {}).pop("managedFields", None)
    return obj


def object_key(obj: dict[str, Any]) -> str:
    """``namespace/name`` for namespaced objects, ``name`` for cluster-scoped ones."""
    return meta(obj).key


def split_key(key: str) -> tuple[str | None, str]:
    ns, _, name = key.rpartition("/")
    return (ns or None), name


class Store:
    """Thread-safe object cache with secondary indexes (client-go's Indexer)."""

    def __init__(self, indexers: dict[str, IndexFunc] | None = None) -> None:
        self._lock = threading.RLock()
        self._items: dict[str, dict[str, Any]] = {}
        self._indexers = dict(indexers or {})
        self._indices: dict[str, dict[str, set[str]]] = {name: {} for name in self._indexers}

    def add_indexer(self, name: str, fn: IndexFunc) -> None:
        with self._lock:
            self._indexers[name] = fn
            self._indices[name] = {}
            for key, obj in self._items.items():
                self._index(name, key, obj)

    def _index(self, name: str, key: str, obj: dict[str, Any]) -> None:
        for value in self._indexers[name](obj):
            self._indices[name].setdefault(value, set()).add(key)

    def _unindex(self, key: str, obj: dict[str, Any]) -> None:
        for name, fn in self._indexers.items():
            for value in fn(obj):
                keys = self._indices[name].get(value)
                if keys:
                    keys.discard(key)
                    if not keys:
                        del self._indices[name][value]

    def put(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        key = object_key(obj)
        with self._lock:
            old = self._items.get(key)
            if old is not None:
                self._unindex(key, old)
            self._items[key] = obj
            for name in self._indexers:
                self._index(name, key, obj)
            return old

    def remove(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._unindex(key, old)
            return old

    def get(self, key: str) -> dict[str, Any] | None:
        """A deep copy, so callers may mutate it freely."""
        with self._lock:
            obj = self._items.get(key)
            return copy.deepcopy(obj) if obj is not None else None

    def get_raw(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            return self._items.get(key)

    def get_raw_many(self, keys: Iterable[str]) -> builtins.list[dict[str, Any] | None]:
        """``get_raw`` of each key, under one acquisition of the lock: a cache's status reads its
        1,000 members' objects, and 2,000 acquisitions contended by 16 workers and the informers'
        threads were 8.9 % of the coordinator's GIL samples (py-spy --gil, 10,000 nodes)."""
        with self._lock:
            return [self._items.get(k) for k in keys]

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def list(self, copy_objects: bool = True) -> list[dict[str, Any]]:
        """All objects; ``copy_objects=False`` skips the deep copies for read-only callers (hot
        loops over thousands of objects), who then must not mutate what they get."""
        with self._lock:
            objs = list(self._items.values())
        return [copy.deepcopy(o) for o in objs] if copy_objects else objs

    def by_index(self, name: str, value: str, copy_objects: bool = True) -> builtins.list[dict[str, Any]]:
        with self._lock:
            objs = [self._items[k] for k in sorted(self._indices[name].get(value, ()))]
        return [copy.deepcopy(o) for o in objs] if copy_objects else objs

    def count(self, name: str, value: str) -> int:
        """How many objects ``value`` indexes under ``name`` (no list built)."""
        with self._lock:
            return len(self._indices[name].get(value, ()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class WatchError(Exception):
    """The server cannot serve the watch from our resourceVersion (an ERROR event): relist."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class WatchLost(Exception):
    """The open watch's stream broke mid-way: no clean end, no answer from the server (see run())."""


class Gone(WatchError):
    """The watch's resourceVersion is too old (410): relist."""

    def __init__(self, message: str) -> None:
        super().__init__(410, message)


#: Resumed watches that fail in a row (no answer from the server) before the informer relists.
RESUME_LIMIT = 5


def unreachable(exc: BaseException) -> bool:
    """Whether a failure means the server could not be reached at all (refused, or no connection
    within the connect timeout), as opposed to an answer or a connection lost mid-stream."""
    import urllib3.exceptions as u3

    seen: BaseException | None = exc
    for _ in range(8):  # through MaxRetryError's reason and exception chains
        if seen is None:
            return False
        if isinstance(seen, (u3.NewConnectionError, u3.ConnectTimeoutError, ConnectionRefusedError)):
            return True
        seen = seen.reason if isinstance(seen, u3.MaxRetryError) else (seen.__cause__ or seen.__context__)
    return False


def needs_relist(exc: BaseException) -> bool:
    """Whether a failed list/watch must start again from a LIST: any answer from the server
    saying it cannot serve our version (an ERROR event, an error status other than 429). A
    failure without an answer (connection refused, reset, timed out) may resume the watch."""
    if isinstance(exc, WatchError):
        return True
    if isinstance(exc, ApiException):
        return bool(exc.status) and exc.status != 429
    return False


class StreamingListUnsupported(Exception):
    """The API server does not stream lists (no WatchList): list in pages instead."""


#: The bookmark annotation that ends a streamed list's initial events.
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
#: Seconds a streamed list may take before the server ends it (an old server that ignores
#: sendInitialEvents sends a plain watch that never has the end bookmark: we fall back then).
STREAM_LIST_TIMEOUT = 120
_WIRE_NAMES = {"label_selector": "labelSelector", "field_selector": "fieldSelector"}


def _lines(resp: Any) -> Iterable[bytes]:
    """The newline-delimited JSON events of a watch response, one line at a time."""
    buf = b""
    for chunk in resp.stream(amt=65536, decode_content=True):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line


class Informer:
    def __init__(
        self,
        kube: Kube,
        resource: Resource,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        indexers: dict[str, IndexFunc] | None = None,
        watch_timeout: int = 300,
        retry_delay: float = 1.0,
        page_size: int = 500,
        transform: Transform = drop_managed_fields,
    ) -> None:
        self.kube = kube
        self.resource = resource
        self.namespace = namespace
        selectors = (("label_selector", label_selector), ("field_selector", field_selector))
        self.selectors = {k: v for k, v in selectors if v}
        self.store = Store(indexers)
        self.watch_timeout = watch_timeout
        self.retry_delay = retry_delay
        self.page_size = page_size  # list in pages so 5000 nodes are not one giant response
        self.transform = transform
        #: Whether the server streams lists: None until the first try, then True or False.
        self.streaming: bool | None = None
        self.synced = threading.Event()
        self.last_resource_version: str | None = None
        #: Counters a test or a metrics endpoint can read: lists done, watches opened, 410s seen.
        self.stats = {"lists": 0, "watches": 0, "gone": 0, "errors": 0, "relists": 0, "went_back": 0}
        #: The last list/watch failure, one line (what a start-up that cannot sync reports).
        self.last_error = ""
        self._handlers: list[Handler] = []
        #: Set while the cache follows the server: after a list, and while a watch is open; cleared
        #: by any failure until the next list or watch succeeds (see :attr:`current`).
        self._current = threading.Event()
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread: threading.Thread | None = None

    def add_handler(self, handler: Handler) -> None:
        """Register before :meth:`start`; a handler added later gets the current objects as ADDED."""
        self._handlers.append(handler)
        if self.synced.is_set():
            for obj in self.store.list():
                handler(ADDED, obj, None)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> Informer:
        self._thread = threading.Thread(target=self.run, name=f"informer-{self.resource.plural}", daemon=True)
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread is not None

    def wait_for_sync(self, timeout: float | None = None) -> bool:
        return self.synced.wait(timeout)

    @property
    def current(self) -> bool:
        """Synced and following the server now (not retrying after a failed list or watch)."""
        return self.synced.is_set() and self._current.is_set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.drop_connection()
        if self._thread is not None:
            self._thread.join(timeout)

    def drop_connection(self) -> None:
        """Close the open watch (as a network failure would); the loop resumes from the last version."""
        resp = self._resp
        if resp is not None:
            try:
                resp.shutdown() if hasattr(resp, "shutdown") else resp.close()
            except Exception:
                log.debug("closing watch response failed", exc_info=True)

    def run(self) -> None:
        need_list = True
        failures = 0  # in a row, for the backoff
        resumes = 0  # failed resumes of the watch in a row
        while not self._stop.is_set():
            try:
                if not need_list and self._server_behind():
                    # An etcd restore (or a lagging replica): what was written between the server's
                    # version and ours will never come through a watch. Only a fresh list catches up.
                    log.warning("%s: the server's current version is older than %s, where our watch stands "
                                "(its store went back in time: an etcd restore?); relisting", self.resource.plural,
                                self.last_resource_version)
                    self.stats["relists"] += 1
                    self.stats["went_back"] += 1
                    need_list = True
                if need_list:
                    self._list()
                    need_list = False
                self._watch()
                failures = resumes = 0
            except Exception as exc:
                if self._stop.is_set():
                    break
                self._current.clear()
                if isinstance(exc, WatchLost):
                    # A watch lost mid-stream: the server may have restarted on a restored store, and
                    # the version check before the next watch can be raced: once the cluster writes
                    # past our version (CI saw it within the 2 s backoff), a resumed watch silently
                    # skips what was written in the gap. Only a list compares contents (and reports
                    # real changes only). A watch the server ends on time still resumes.
                    need_list = True
                    self.stats["relists"] += 1
                    log.warning("%s: watch lost mid-stream (%s); relisting (a restarted API server may "
                                "stand on a restored store)", self.resource.plural, type(exc.__cause__).__name__)
                gone = isinstance(exc, Gone) or (isinstance(exc, ApiException) and exc.status == 410)
                if gone:
                    self.stats["gone"] += 1
                    log.info("%s: watch version expired, relisting", self.resource.plural)
                    need_list = True
                    self.stats["relists"] += 1
                    continue
                self.stats["errors"] += 1
                self.last_error = (f"HTTP {exc.status}: {' '.join(error_message(exc).split())[:300]}"
                                   if isinstance(exc, ApiException) else f"{type(exc).__name__}: {_one_line(exc)}")
                resumes = 0 if need_list else resumes + 1
                if not need_list and unreachable(exc):
                    # The server went away: it may come back on another store (an etcd restore, a
                    # failover), where our version means nothing. The first connection relists.
                    need_list = True
                    self.stats["relists"] += 1
                    log.warning("%s: the API server cannot be reached (%s); relisting once it answers",
                                self.resource.plural, _one_line(exc))
                elif not need_list and (needs_relist(exc) or resumes >= RESUME_LIMIT):
                    # The server cannot (or, after several tries, does not) serve a watch from our
                    # version: only a fresh list catches up (client-go's reflector does the same).
                    need_list = True
                    self.stats["relists"] += 1
                    log.warning("%s: watch from version %s failed (%s: %s), relisting", self.resource.plural,
                                self.last_resource_version, type(exc).__name__, _one_line(exc))
                # Back off while the API server is unreachable or refuses (1x, 2x, 4x ... up to 30x
                # retry_delay), so a fleet of agents does not hammer a recovering server.
                delay = self.retry_delay * min(30, 2**failures)
                failures += 1
                log.warning("%s: list/watch failed (%s), retrying in %.1fs", self.resource.plural,
                            type(exc).__name__, delay)
                self._stop.wait(delay)

    # -- list and watch ---------------------------------------------------------------------
    def _list(self) -> None:
        if self.streaming is not False:
            try:
                self._stream_list()
                self.streaming = True
                return
            except StreamingListUnsupported as exc:
                self.streaming = False
                log.info("%s: %s; listing in pages", self.resource.plural, exc)
        self._paged_list()

    def _stream_list(self) -> None:
        query: dict[str, Any] = {_WIRE_NAMES[k]: v for k, v in self.selectors.items()}
        # No resourceVersion with NotOlderThan: at least as fresh as etcd now, served from the watch cache.
        query.update(watch="true", sendInitialEvents="true", allowWatchBookmarks="true",
                     resourceVersionMatch="NotOlderThan", timeoutSeconds=STREAM_LIST_TIMEOUT)
        try:
            resp = self.kube.stream_response(self.resource, self.namespace, query,
                                             timeout=(10, STREAM_LIST_TIMEOUT + 30))
        except ApiException as exc:
            if exc.status in (400, 422):  # a server with the WatchList feature off says so
                raise StreamingListUnsupported(f"streamed list refused ({exc.status})") from exc
            raise
        self._resp = resp
        objects: dict[str, dict[str, Any]] = {}
        version = None
        try:
            for line in _lines(resp):
                if self._stop.is_set():
                    return
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(status=obj.get("code") or 500, reason=f"{obj.get('reason')}: "
                                                                              f"{obj.get('message')}")
                if kind == "BOOKMARK":
                    m = meta(obj)
                    if m.annotations.get(INITIAL_EVENTS_END) == "true":
                        version = m.resource_version or None
                        break
                    continue
                obj.setdefault("apiVersion", self.resource.api_version)
                obj.setdefault("kind", self.resource.kind)
                if kind == DELETED:
                    objects.pop(object_key(obj), None)
                else:
                    objects[object_key(obj)] = self.transform(obj)
        finally:
            self._resp = None
            resp.close()
            resp.release_conn()
        if version is None:
            raise StreamingListUnsupported("the server ended the streamed list without its end bookmark")
        self.stats["lists"] += 1
        self._replace(list(objects.values()))
        self.last_resource_version = version
        self._current.set()
        self.synced.set()

    def _paged_list(self) -> None:
        items: list[dict[str, Any]] = []
        query: dict[str, Any] = dict(self.selectors, limit=self.page_size)
        if not self.synced.is_set():
            # The first list, as client-go's reflector: resourceVersion "0" is served from the API
            # server's watch cache (any version it has), not read from etcd. A relist (after the
            # watch could not go on) asks for the current state instead: "0" could go back in time.
            query["resource_version"] = "0"
        while True:
            page = self.kube.list(self.resource, self.namespace, **query)
            for obj in page.get("items") or []:
                # List items carry no apiVersion/kind; add them so handlers see whole objects.
                obj.setdefault("apiVersion", self.resource.api_version)
                obj.setdefault("kind", self.resource.kind)
                items.append(self.transform(obj))
            token = list_meta(page).continue_token
            if not token:
                break
            query.pop("resource_version", None)  # the continue token carries the list's version
            query["_continue"] = token
        self.stats["lists"] += 1
        self._replace(items)
        self.last_resource_version = list_meta(page).resource_version
        self._current.set()
        self.synced.set()

    def _replace(self, items: list[dict[str, Any]]) -> None:
        """Make the cache equal to a fresh list, notifying only real differences."""
        seen = set()
        for obj in items:
            seen.add(object_key(obj))
            self._apply(ADDED, obj)
        for key in self.store.keys():  # noqa: SIM118 (Store is not a dict)
            if key not in seen:
                old = self.store.remove(key)
                if old is not None:
                    self._notify(DELETED, old, None)

    def _watch(self) -> None:
        query = dict(
            self.selectors,
            resource_version=self.last_resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout,
            # A read timeout longer than the server's keeps a silently dead connection from hanging us.
            _request_timeout=(10, self.watch_timeout + 30),
        )
        self._resp = resp = self.kube.watch_response(self.resource, self.namespace, **query)
        self.stats["watches"] += 1
        self._current.set()
        ended = False
        try:
            if self._stop.is_set():  # stop() ran while we were connecting and found no response to close
                return
            for line in _lines(resp):
                if self._stop.is_set():
                    return
                self._event(json.loads(line))
            ended = True
        except (WatchError, ApiException):
            raise  # the server answered: run() decides from the answer
        except Exception as exc:
            if self._stop.is_set():
                return
            raise WatchLost(_one_line(exc)) from exc
        finally:
            self._resp = None
            if not ended:
                # Left mid-stream (stopped, an error): the server keeps sending events on this
                # connection, so it must not go back to the pool, where the next request of the
                # same client (a webhook's lookup) would read a watch event as its answer and wait.
                resp.close()
            resp.release_conn()

    def _server_behind(self) -> bool:
        """Whether the server's current resourceVersion is older than ours. Versions are opaque
        to clients in principle; etcd's are integers, and only then is this checked."""
        page = self.kube.list(self.resource, self.namespace, **dict(self.selectors, limit=1))
        theirs = list_meta(page).resource_version
        try:
            return int(str(theirs)) < int(str(self.last_resource_version))
        except ValueError:
            return False

    def _event(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", ""))
            raise WatchError(int(obj.get("code") or 500), f"{obj.get('reason')}: {obj.get('message')}")
        rv = meta(obj).resource_version or None
        if kind == "BOOKMARK":
            self.last_resource_version = rv or self.last_resource_version
            return
        obj.setdefault("apiVersion", self.resource.api_version)
        obj.setdefault("kind", self.resource.kind)
        obj = self.transform(obj)
        if kind == DELETED:
            old = self.store.remove(object_key(obj))
            self._notify(DELETED, obj, old)
        elif kind in (ADDED, MODIFIED):
            self._apply(kind, obj)
        if rv:
            self.last_resource_version = rv

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        old = self.store.get_raw(object_key(obj))
        if old is not None and meta(old).resource_version == meta(obj).resource_version:
            return  # already seen this exact version (a relist or a replayed event): no work
        self.store.put(obj)
        self._notify(MODIFIED if old is not None else ADDED, obj, old)

    def _notify(self, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        for handler in self._handlers:
            try:
                handler(kind, obj, old)
            except Exception:
                log.exception("%s: event handler failed", self.resource.plural)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def wait_for_all(informers: Iterable[Informer], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    return all(inf.wait_for_sync(max(0.0, deadline - time.monotonic())) for inf in informers)
