"""Sizes in flags and environment variables: one syntax, one meaning, binary.

``16M``, ``16Mi``, ``16MB`` and ``16MiB`` are all 16 x 2**20 bytes, in every command (``modelcache``,
``storage-initializer``'s ``MODELCACHE_*`` variables, ``modelcache-agent``, the benchmarks): a
number, optionally with a fraction (``1.5G``), then ``K``, ``M``, ``G``, ``T`` or ``P`` in any
case, optionally followed by ``i``, ``B`` or ``iB``. A plain number is bytes.

Kubernetes objects are another matter: ``storageLimit`` and ``modelSize`` are Kubernetes
quantities, where ``100G`` is 10**11 bytes and ``100Gi`` 100 x 2**30, exactly as every other
Kubernetes tool reads them (``modelcache.kube.quantity``).
"""

from __future__ import annotations

import re

_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*(?:([kmgtp])(?:i?b|i)?|b)?\s*", re.IGNORECASE)
EXAMPLES = "16M = 16Mi = 16MiB = 16 x 2^20 bytes; 1.5G; 1048576"


def parse_size(text: str) -> int:
    """Bytes of ``text``; ValueError (naming the examples) when it is not a size."""
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size ({EXAMPLES})")
    return int(float(m.group(1)) * (1 << (10 * _POWERS[(m.group(2) or "").lower()])))
