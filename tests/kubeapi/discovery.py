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


OPENAPI_V2_JSON = {"swagger": "2.0", "info": {"title": "Kubernetes", "version": VERSION["gitVersion"]},
                   "paths": {}, "definitions": {}}


def _pb_string(field: int, value: str) -> bytes:
    data = value.encode()
    return bytes([field << 3 | 2, len(data)]) + data


def openapi_v2_protobuf() -> bytes:
    """gnostic openapi_v2.Document{swagger: "2.0", info: {title, version}, paths: {}}."""
    info = _pb_string(1, "Kubernetes") + _pb_string(2, VERSION["gitVersion"])
    return _pb_string(1, "2.0") + bytes([2 << 3 | 2, len(info)]) + info + bytes([8 << 3 | 2, 0])
