"""API errors rendered exactly as kube-apiserver renders them (a `Status` object)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.kubeapi.resources import ResourceType


@dataclass
class FieldError:
    """One entry of a 422 Invalid response, formatted like Go's `field.Error`."""

    field: str
    type: str  # Required value | Unsupported value | Invalid value | Forbidden | Too many | Duplicate value
    value: Any = None
    detail: str = ""

    REASONS = {
        "Required value": "FieldValueRequired",
        "Unsupported value": "FieldValueNotSupported",
        "Invalid value": "FieldValueInvalid",
        "Forbidden": "FieldValueForbidden",
        "Too many": "FieldValueTooMany",
        "Duplicate value": "FieldValueDuplicate",
    }

    def body(self) -> str:
        if self.type in ("Invalid value", "Unsupported value", "Duplicate value"):
            text = f"{self.type}: {go_value(self.value)}"
        else:
            text = self.type
        return f"{text}: {self.detail}" if self.detail else text

    def message(self) -> str:
        return f"{self.field}: {self.body()}"

    def cause(self) -> dict[str, str]:
        return {"reason": self.REASONS.get(self.type, "FieldValueInvalid"), "message": self.body(), "field": self.field}


def go_value(value: Any) -> str:
    """Go's %v/%q-ish rendering used in field errors: strings quoted, numbers plain."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return str(value)
    return '"' + type(value).__name__ + '"'


@dataclass
class ApiError(Exception):
    code: int
    reason: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def _details(rt: ResourceType, name: str) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "kind": rt.plural}
    if rt.group:
        d["group"] = rt.group
    return d


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.group_resource} "{name}" not found', _details(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{rt.group_resource} "{name}" already exists', _details(rt, name))


def conflict(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.group_resource} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        _details(rt, name),
    )


def invalid(rt: ResourceType, name: str, errors: list[FieldError]) -> ApiError:
    msgs = [e.message() for e in errors]
    summary = msgs[0] if len(msgs) == 1 else "[" + ", ".join(msgs) + "]"
    details = {**_details(rt, name), "kind": rt.kind, "causes": [e.cause() for e in errors]}
    return ApiError(422, "Invalid", f'{rt.group_kind} "{name}" is invalid: {summary}', details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)
