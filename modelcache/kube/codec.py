"""Dataclass <-> Kubernetes JSON codec.

Python fields are snake_case; the JSON key is the camelCase of the field name unless the
field's metadata has ``{JSON: "name"}``. ``None`` and empty collections are omitted (Go's
``omitempty``) unless its metadata is ``KEEP``. Keys we do not model are kept in
``extra`` so that reading and writing back an object written by a newer KServe (or a user)
never drops its fields.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from typing import Any, TypeVar, get_args, get_origin

T = TypeVar("T", bound="Codec")

_HINTS: dict[type, dict[str, Any]] = {}


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


#: Field metadata: emit the field even when it is an empty list/dict (required fields).
KEEP = {"keep": True}
#: Field metadata key for a JSON name that is not the camelCase of the field name.
JSON = "json"


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return tp


def _encode(value: Any) -> Any:
    if isinstance(value, Codec):
        return value.to_dict()
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return copy.deepcopy(value)


def _decode(tp: Any, raw: Any) -> Any:
    if raw is None:
        return None
    tp = _strip_optional(tp)
    origin = get_origin(tp)
    if origin is list:
        (item,) = get_args(tp) or (Any,)
        return [_decode(item, v) for v in raw] if isinstance(raw, list) else copy.deepcopy(raw)
    if origin is dict:
        _key, val = get_args(tp) or (str, Any)
        return {k: _decode(val, v) for k, v in raw.items()} if isinstance(raw, dict) else copy.deepcopy(raw)
    if isinstance(tp, type) and issubclass(tp, Codec):
        return tp.from_dict(raw) if isinstance(raw, dict) else raw
    return copy.deepcopy(raw)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, list | dict) and not value)


class Codec:
    """Mixin for dataclasses: ``to_dict()`` / ``from_dict()`` with exact Kubernetes field names.

    Subclasses must be dataclasses with an ``extra: dict`` field (declared last) that holds
    the keys they do not model.
    """

    extra: dict[str, Any]

    @classmethod
    def _fields(cls) -> list[tuple[dataclasses.Field, str]]:
        out = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name == "extra":
                continue
            out.append((f, f.metadata.get("json") or camel(f.name)))
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = copy.deepcopy(self.extra)
        for f, key in self._fields():
            value = _encode(getattr(self, f.name))
            if isinstance(getattr(self, f.name), Codec) and value == {} and not f.metadata.get("keep"):
                out.pop(key, None)
                continue
            if _empty(value) and not (f.metadata.get("keep") and value is not None):
                out.pop(key, None)
                continue
            out[key] = value
        return out

    @classmethod
    def from_dict(cls: type[T], raw: dict[str, Any] | None) -> T:
        raw = dict(raw or {})
        hints = _hints(cls)
        kwargs: dict[str, Any] = {}
        for f, key in cls._fields():
            if key in raw:
                value = _decode(hints[f.name], raw.pop(key))
                if value is not None:
                    kwargs[f.name] = value
        kwargs["extra"] = copy.deepcopy(raw)
        return cls(**kwargs)
