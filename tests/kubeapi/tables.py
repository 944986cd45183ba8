"""Server-side printing (`Accept: application/json;as=Table;g=meta.k8s.io;v=v1`), which is how
`kubectl get` shows a CRD's additionalPrinterColumns."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from tests.kubeapi.resources import ResourceType

_NAME_COLUMN = {"name": "Name", "type": "string", "format": "name", "priority": 0,
                "description": "Name must be unique within a namespace."}
_AGE_COLUMN = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


def _json_path(obj: Any, path: str) -> Any:
    """The simple `.a.b[0].c` paths printer columns use (braces optional)."""
    path = path.strip().lstrip("{").rstrip("}")
    cur = obj
    for name, index in re.findall(r"\.([^.\[\]]+)|\[(\d+)\]", path):
        if name:
            cur = cur.get(name) if isinstance(cur, dict) else None
        else:
            cur = cur[int(index)] if isinstance(cur, list) and int(index) < len(cur) else None
        if cur is None:
            return None
    return cur


def human_age(timestamp: str) -> str:
    """Like apimachinery's duration.HumanDuration (close enough for kubectl's AGE column)."""
    try:
        then = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except (TypeError, ValueError):
        return "<unknown>"
    secs = max(0, int((datetime.now(UTC) - then).total_seconds()))
    if secs < 120:
        return f"{secs}s"
    mins = secs // 60
    if mins < 10:
        return f"{mins}m{secs % 60}s" if secs % 60 else f"{mins}m"
    if mins < 180:
        return f"{mins}m"
    hours = mins // 60
    if hours < 48:
        return f"{hours}h"
    return f"{hours // 24}d"


def columns_for(rt: ResourceType) -> list[dict[str, Any]]:
    return rt.printer_columns or [_AGE_COLUMN]


def _cell(col: dict[str, Any], obj: dict[str, Any]) -> Any:
    value = _json_path(obj, col.get("jsonPath", ""))
    if value is None:
        return None
    if col.get("type") == "date":
        return human_age(str(value))
    if isinstance(value, (dict, list)):
        import json
        return json.dumps(value, separators=(",", ":"))
    return value


def _row_object(obj: dict[str, Any], include: str) -> dict[str, Any] | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata", {})}


def to_table(rt: ResourceType, items: list[dict[str, Any]], resource_version: str, include: str = "Metadata",
             with_columns: bool = True) -> dict[str, Any]:
    cols = columns_for(rt)
    table: dict[str, Any] = {"kind": "Table", "apiVersion": "meta.k8s.io/v1",
                             "metadata": {"resourceVersion": resource_version}, "rows": []}
    if with_columns:
        table["columnDefinitions"] = [_NAME_COLUMN] + [
            {"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
             "description": c.get("description", ""), "priority": c.get("priority", 0)} for c in cols]
    for obj in items:
        row: dict[str, Any] = {"cells": [obj["metadata"]["name"], *(_cell(c, obj) for c in cols)]}
        ro = _row_object(obj, include)
        if ro is not None:
            row["object"] = ro
        table["rows"].append(row)
    return table
