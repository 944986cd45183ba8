"""Event predicates for ``Controller.watch`` (controller-runtime's ``predicate.Funcs``, ``And``, ``Or``).

A predicate decides, from an informer event ``(event, obj, old)``, whether it wakes a controller.
Most say "every add and delete, and an update only if it changed X": ``on_update(X, ...)`` builds
that from views of an object (``spec_of``, ``labels_of``, ...), each compared between old and new. (An
absent ``labels`` or ``annotations`` reads as empty, as the API server, which omits empty maps,
means it.) ``modelcache.kube.controller.generation_or_meta_changed`` is the status-only filter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modelcache.kube.objects import meta

Obj = dict[str, Any]
#: predicate(event_type, obj, old) -> enqueue? (modelcache.kube.controller.Controller.watch)
Predicate = Callable[[str, Obj, "Obj | None"], bool]
#: A part of an object that an update may change (compared with ``!=``).
View = Callable[[Obj], Any]

MODIFIED = "MODIFIED"


def spec_of(obj: Obj) -> Any:
    return obj.get("spec")


def labels_of(obj: Obj) -> Any:
    return meta(obj).labels


def annotations_of(obj: Obj) -> Any:
    return meta(obj).annotations


def deletion_of(obj: Obj) -> Any:
    return meta(obj).deletion_timestamp


def on_update(*views: View) -> Predicate:
    """Adds and deletes pass (and an update with no old object); an update passes when any view
    differs between the old object and the new."""
    def changed(event: str, obj: Obj, old: Obj | None) -> bool:
        if event != MODIFIED or old is None:
            return True
        return any(view(obj) != view(old) for view in views)

    return changed


def event_in(*events: str) -> Predicate:
    """Only these event types (say, ADDED and DELETED: existence, not content)."""
    def passes(event: str, _obj: Obj, _old: Obj | None) -> bool:
        return event in events

    return passes


def any_of(*predicates: Predicate) -> Predicate:
    def passes(event: str, obj: Obj, old: Obj | None) -> bool:
        return any(p(event, obj, old) for p in predicates)

    return passes


def all_of(*predicates: Predicate) -> Predicate:
    def passes(event: str, obj: Obj, old: Obj | None) -> bool:
        return all(p(event, obj, old) for p in predicates)

    return passes
