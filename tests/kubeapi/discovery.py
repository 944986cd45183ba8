"""Discovery documents (/api, /apis, group and group-version resource lists), /version and a
minimal OpenAPI v2 document (JSON, or protobuf for kubectl) that declares no schemas, so
client-side validation in kubectl passes every kind through to the server's own validation."""

from __future__ import annotations

from typing import Any

from tests.kubeapi.resources import Registry

VERSION = {
    "major": "1", "minor": "32", "gitVersion": "v1.32.0-modelcache-kubeapi", "gitCommit": "0" * 40,
    "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.23.0", "compiler": "gc",
    "platform": "linux/amd64",
}


def api_versions(server_address: str) -> dict[str, Any]:
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}]}


def _group(name: str, versions: list[str]) -> dict[str, Any]:
    vs = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": vs, "preferredVersion": vs[0]}


def api_group_list(registry: Registry) -> dict[str, Any]:
    groups = [_group(g, vs) for g, vs in registry.groups().items() if g]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def api_group(registry: Registry, group: str) -> dict[str, Any] | None:
    versions = registry.groups().get(group)
    if not versions or not group:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(group, versions)}


def resource_list(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    types = [rt for rt in registry.all() if rt.group == group and rt.version == version]
    if not types:
        return None
    gv = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
            "resources": [r for rt in types for r in rt.discovery()]}


# The OpenAPI v2 document lists, per kind, only what kubectl reads from it: a PATCH operation with
# the x-kubernetes-group-version-kind extension and the dryRun / fieldValidation / fieldManager
# query parameters (kubectl 1.20 refuses --dry-run=server without them). No definitions, so
# kubectl's client-side schema validation has nothing to check and defers to the server.
_QUERY_PARAMS = ("dryRun", "fieldManager", "fieldValidation")


def _paths(registry: Registry) -> list[tuple[str, str]]:
    """(path, x-kubernetes-group-version-kind as YAML) for every served kind."""
    out = []
    for rt in sorted(registry.all(), key=lambda r: (r.group, r.version, r.plural)):
        prefix = f"/apis/{rt.group}/{rt.version}" if rt.group else "/api/v1"
        scope = "/namespaces/{namespace}" if rt.namespaced else ""
        gvk = f'group: "{rt.group}"\nkind: {rt.kind}\nversion: {rt.version}\n'
        out.append((f"{prefix}{scope}/{rt.plural}/{{name}}", gvk))
    return out


def openapi_v2_json(registry: Registry) -> dict[str, Any]:
    paths = {}
    for path, gvk in _paths(registry):
        fields = dict(line.split(": ", 1) for line in gvk.strip().splitlines())
        paths[path] = {"patch": {
            "parameters": [{"name": n, "in": "query", "type": "string", "uniqueItems": True} for n in _QUERY_PARAMS],
            "x-kubernetes-action": "patch",
            "x-kubernetes-group-version-kind": {k: v.strip('"') for k, v in fields.items()},
            "responses": {"200": {"description": "OK"}}}}
    return {"swagger": "2.0", "info": {"title": "Kubernetes", "version": VERSION["gitVersion"]},
            "paths": paths, "definitions": {}}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _pb(field: int, payload: bytes | str) -> bytes:
    """One length-delimited protobuf field (strings and embedded messages)."""
    data = payload.encode() if isinstance(payload, str) else payload
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _named_any(name: str, yaml_text: str) -> bytes:
    return _pb(1, name) + _pb(2, _pb(2, yaml_text))  # NamedAny{name, value: Any{yaml}}


def openapi_v2_protobuf(registry: Registry) -> bytes:
    """The same document as gnostic openapi_v2.Document protobuf, which is what kubectl asks for."""
    paths = b""
    for path, gvk in _paths(registry):
        params = b"".join(
            _pb(8, _pb(1, _pb(2, _pb(3, _pb(2, "query") + _pb(4, name)))))  # ParametersItem>Parameter>NonBody>Query
            for name in _QUERY_PARAMS)
        operation = params + _pb(13, _named_any("x-kubernetes-group-version-kind", gvk)) + \
            _pb(13, _named_any("x-kubernetes-action", "patch\n"))
        paths += _pb(2, _pb(1, path) + _pb(2, _pb(8, operation)))  # Paths.path: NamedPathItem{name, PathItem.patch}
    info = _pb(1, "Kubernetes") + _pb(2, VERSION["gitVersion"])
    return _pb(1, "2.0") + _pb(2, info) + _pb(8, paths)
