"""HTTP front end: routes Kubernetes REST paths to the store, discovery and watch modules."""

from __future__ import annotations

import json
import sys
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from tests.kubeapi import discovery
from tests.kubeapi.errors import ApiError, bad_request
from tests.kubeapi.resources import Registry, ResourceType
from tests.kubeapi.selectors import parse_field_selector, parse_label_selector
from tests.kubeapi.store import DeleteOptions, Store, WriteOptions
from tests.kubeapi.tables import to_table, wants_table
from tests.kubeapi.watch import WatchRequest, run_watch

DEFAULT_WATCH_TIMEOUT = 1800.0


class Route:
    def __init__(self, group: str, version: str, rest: list[str]) -> None:
        self.group, self.version = group, version
        self.watch = bool(rest) and rest[0] == "watch"
        if self.watch:
            rest = rest[1:]
        self.namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
            self.namespace, rest = rest[1], rest[2:]
        self.plural = rest[0] if rest else ""
        self.name = rest[1] if len(rest) > 1 else None
        self.sub = rest[2] if len(rest) > 2 else None
        self.valid = bool(rest) and len(rest) <= 3


def _not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


class KubeAPIServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], registry: Registry, store: Store, bookmark_interval: float,
                 verbose: bool = False) -> None:
        super().__init__(address, Handler)
        self.registry = registry
        self.store = store
        self.bookmark_interval = bookmark_interval
        self.verbose = verbose

    def shutdown(self) -> None:
        self.store.close()
        super().shutdown()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: KubeAPIServer

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            sys.stderr.write("kubeapi: " + (format % args) + "\n")

    # ----- plumbing --------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _send(self, code: int, body: bytes, content_type: str = "application/json",
              warnings: list[str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        for w in warnings or []:
            self.send_header("Warning", '299 - "' + w.replace("\\", "\\\\").replace('"', '\\"') + '"')
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, obj: Any, warnings: list[str] | None = None) -> None:
        self._send(code, json.dumps(obj).encode(), warnings=warnings)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _parsed_body(self, content_type: str) -> Any:
        raw = self._raw_body
        if not raw:
            return None
        if "protobuf" in content_type:
            # kubectl's typed generators (`kubectl create namespace NAME`, ...) send protobuf; decoding it
            # needs every type's .proto, so they get the real server's answer to an unknown format.
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                           "accepted media types include: application/json, application/yaml")
        try:
            if "yaml" in content_type:
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            sys.stderr.write(f"kubeapi: undecodable body, Content-Type {content_type!r}: {raw[:40]!r}\n")
            raise bad_request(f"the body of the request could not be decoded: {exc}") from exc

    def _dispatch(self, method: str) -> None:
        # Read the whole body first: an early error reply must not leave bytes on a kept-alive connection.
        self._raw_body = self._read_body()
        url = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        try:
            self._route(method, url.path)
        except ApiError as err:
            self._json(err.code, err.status())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:
            traceback.print_exc()
            self._json(500, ApiError(500, "InternalError", f"Internal error occurred: {exc}").status())

    # ----- routing ---------------------------------------------------------------------------

    def _route(self, method: str, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        reg = self.server.registry
        if method == "GET" and path.rstrip("/") in ("/version", "/healthz", "/readyz", "/livez"):
            if path.startswith("/version"):
                self._json(200, discovery.VERSION)
            else:
                self._send(200, b"ok", "text/plain")
            return
        if path.rstrip("/") == "/openapi/v2" and method == "GET":
            if "protobuf" in (self.headers.get("Accept") or ""):
                self._send(200, discovery.openapi_v2_protobuf(self.server.registry),
                           "application/com.github.proto-openapi.spec.v2.v1.0+protobuf")
            else:
                self._json(200, discovery.openapi_v2_json(self.server.registry))
            return
        if parts[:1] == ["_kubeapi"] and method == "POST":
            self._test_control(parts[1:])
            return
        if not parts or parts[0] not in ("api", "apis"):
            raise _not_found()
        if parts[0] == "api":
            if len(parts) == 1:
                self._json(200, discovery.api_versions(f"{self.server.server_address[0]}:"
                                                       f"{self.server.server_address[1]}"))
                return
            group, version, rest = "", parts[1], parts[2:]
        else:
            if len(parts) == 1:
                self._json(200, discovery.api_group_list(reg))
                return
            if len(parts) == 2:
                doc = discovery.api_group(reg, parts[1])
                if doc is None:
                    raise _not_found()
                self._json(200, doc)
                return
            group, version, rest = parts[1], parts[2], parts[3:]
        if not rest:
            doc = discovery.resource_list(reg, group, version)
            if doc is None or method != "GET":
                raise _not_found()
            self._json(200, doc)
            return
        route = Route(group, version, rest)
        rt = reg.get(group, version, route.plural) if route.valid else None
        if rt is None or (route.namespace and not rt.namespaced):
            raise _not_found()
        if route.sub is not None and not (route.sub == "status" and rt.status):
            raise _not_found()
        if rt.namespaced and route.name is not None and not route.namespace:
            raise _not_found()
        self._resource(method, rt, route)

    def _test_control(self, parts: list[str]) -> None:
        """Test-only hooks, outside the Kubernetes API paths."""
        store = self.server.store
        if parts == ["compact"]:
            self._json(200, {"compactedResourceVersion": str(store.compact())})
        elif parts == ["drop-watches"]:
            store.drop_watches()
            self._json(200, {"dropped": True})
        else:
            raise _not_found()

    def _resource(self, method: str, rt: ResourceType, route: Route) -> None:
        store = self.server.store
        ns, name = route.namespace, route.name
        ctype = (self.headers.get("Content-Type") or "application/json").split(";")[0].strip()
        if method == "GET":
            if route.watch or self.query.get("watch", "").lower() in ("true", "1"):
                self._watch(rt, route)
            elif name is None:
                self._list(rt, ns)
            else:
                obj = store.get(rt, ns, name)
                if wants_table(self.headers.get("Accept") or ""):
                    self._json(200, to_table(rt, [obj], obj["metadata"]["resourceVersion"], self._include()))
                else:
                    self._json(200, obj)
        elif method == "POST" and name is None:
            wopts = self._write_options()
            self._json(201, store.create(rt, ns, self._parsed_body(ctype), wopts), wopts.warnings)
        elif method == "PUT" and name is not None:
            wopts = self._write_options()
            self._json(200, store.replace(rt, ns, name, self._parsed_body(ctype), route.sub, wopts), wopts.warnings)
        elif method == "PATCH" and name is not None:
            body = self._parsed_body(ctype)
            if body is None:
                raise bad_request("the body of the request was empty")
            wopts = self._write_options()
            self._json(200, store.patch(rt, ns, name, ctype, body, route.sub, wopts), wopts.warnings)
        elif method == "DELETE":
            opts = DeleteOptions.from_body(self._parsed_body(ctype), self.query.get("propagationPolicy"),
                                           self.query.get("dryRun") == "All")
            if name is None:
                items = store.delete_collection(rt, ns, self._labels(), self._fields(rt), opts)
                self._json(200, {"kind": rt.kind + "List", "apiVersion": rt.group_version,
                                 "metadata": {"resourceVersion": str(store.rv)}, "items": items})
            else:
                out = store.delete(rt, ns, name, opts)
                self._json(200, out)
        else:
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested "
                           "resource")

    def _write_options(self) -> WriteOptions:
        mode = self.query.get("fieldValidation") or "Warn"
        if mode not in ("Strict", "Warn", "Ignore"):
            raise bad_request(f"fieldValidation must be one of Ignore, Warn, Strict (got {mode!r})")
        return WriteOptions(mode, dry_run=self.query.get("dryRun") == "All")

    def _labels(self) -> list[Any]:
        return parse_label_selector(self.query.get("labelSelector"))

    def _fields(self, rt: ResourceType) -> Any:
        return parse_field_selector(self.query.get("fieldSelector"), rt.field_labels)

    def _include(self) -> str:
        return self.query.get("includeObject", "Metadata")

    def _list(self, rt: ResourceType, ns: str) -> None:
        limit = int(self.query.get("limit") or 0)
        items, rv, cont = self.server.store.list(rt, ns, self._labels(), self._fields(rt), limit,
                                                 self.query.get("continue") or None)
        if wants_table(self.headers.get("Accept") or ""):
            self._json(200, to_table(rt, items, rv, self._include()))
            return
        meta: dict[str, Any] = {"resourceVersion": rv}
        if cont:
            meta["continue"] = cont
        self._json(200, {"kind": rt.kind + "List", "apiVersion": rt.group_version, "metadata": meta,
                         "items": items})

    def _watch(self, rt: ResourceType, route: Route) -> None:
        fields = self._fields(rt)
        if route.name is not None:
            name_fields = fields
            fields = lambda obj: obj["metadata"]["name"] == route.name and name_fields(obj)  # noqa: E731
        timeout = float(self.query.get("timeoutSeconds") or DEFAULT_WATCH_TIMEOUT)
        req = WatchRequest(rt, route.namespace, self._labels(), fields, self.query.get("resourceVersion"),
                           timeout, self.query.get("allowWatchBookmarks", "").lower() in ("true", "1"),
                           self.server.bookmark_interval)
        table = wants_table(self.headers.get("Accept") or "")
        include = self._include()

        def to_wire(obj: dict[str, Any]) -> dict[str, Any]:
            return to_table(rt, [obj], obj["metadata"]["resourceVersion"], include) if table else obj

        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        self.wfile.flush()

        def emit(event: dict[str, Any]) -> None:
            data = json.dumps(event).encode() + b"\n"
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        try:
            run_watch(self.server.store, req, emit, to_wire)
        except ApiError as err:
            emit({"type": "ERROR", "object": err.status()})
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True
