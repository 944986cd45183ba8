"""Kubernetes quantities (``100Gi``, ``1.5T``, ``5e9``): how CRD sizes such as ``storageLimit`` and
``modelSize`` are read, exactly as kubectl reads them (``16M`` is 16,000,000 bytes), by the
Kubernetes client's own parser. Sizes in flags and environment variables are another syntax
(``modelcache.runtime.sizes``, binary)."""

from __future__ import annotations

import math

from kubernetes.utils import parse_quantity as _kube_quantity


def parse_quantity(value: str | int | float | None) -> int | None:
    """A Kubernetes Quantity in bytes (a fraction rounded up, as the API server rounds a
    quantity to its integer form); None when empty or invalid."""
    if value is None or value == "":
        return None
    try:
        return math.ceil(_kube_quantity(value))
    except (ValueError, TypeError, ArithmeticError):
        return None
