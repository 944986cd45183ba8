"""Kubernetes quantities (``100Gi``, ``1.5T``, ``5e9``): how CRD sizes such as ``storageLimit`` and
``modelSize`` are read, exactly as kubectl reads them (``16M`` is 16,000,000 bytes). Sizes in flags
and environment variables are another syntax (``modelcache.sizes``, binary)."""

from __future__ import annotations

import re

_SUFFIX = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "m": 0.001,
}
_QUANTITY = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:[eE]([+-]?\d+))?(Ki|[MGTPE]i|[kMGTPE]|m)?\s*$")


def parse_quantity(value: str | int | float | None) -> int | None:
    """A Kubernetes Quantity (``100Gi``, ``1.5T``, ``5e9``) in bytes; None when empty or invalid."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        return int(value)
    m = _QUANTITY.match(str(value))
    if not m:
        return None
    number, exp, suffix = m.groups()
    result = float(number) * (10 ** int(exp) if exp else 1) * _SUFFIX[suffix or ""]
    return int(result)
