"""Disk reservations: a download is admitted only if it fits, before it writes a byte.

Two budgets are checked: the root's file system (free space minus a safety margin minus what
other downloads in flight have reserved and not yet written) and, when the model's node group
sets one, ``storageLimit`` (everything the store holds plus what is reserved). A model that
cannot fit fails at once with "insufficient space: need X, free Y" instead of ENOSPC halfway.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from modelcache.errors import InsufficientSpaceError
from modelcache.progress import human_bytes

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


@dataclass(frozen=True)
class Reservation:
    key: str
    disk_bytes: int  # still to be written on the file system
    model_bytes: int  # the model's whole size, counted against storageLimit


class Capacity:
    def __init__(self, root: Path, margin: int, used_bytes: Callable[[], int],
                 disk_usage: Callable[[Path], tuple[int, int]] | None = None) -> None:
        self.root = root
        self.margin = margin
        self.used_bytes = used_bytes  # bytes of published models in the store
        self._disk_usage = disk_usage or (lambda p: (lambda u: (u.total, u.free))(shutil.disk_usage(p)))
        self._lock = threading.Lock()
        self._reserved: dict[str, Reservation] = {}

    def disk(self) -> tuple[int, int]:
        """(total, free) bytes of the root's file system."""
        try:
            return self._disk_usage(self.root)
        except OSError:
            return (0, 0)

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(r.disk_bytes for r in self._reserved.values())

    def reserve(self, key: str, disk_bytes: int, model_bytes: int, limit: int | None, what: str) -> None:
        """Reserve or raise InsufficientSpaceError; a second reserve for ``key`` replaces the first."""
        with self._lock:
            others = [r for k, r in self._reserved.items() if k != key]
            _total, free = self.disk()
            free_disk = max(0, free - self.margin - sum(r.disk_bytes for r in others))
            if disk_bytes > free_disk:
                raise InsufficientSpaceError(
                    f"{what}: insufficient space: need {human_bytes(disk_bytes)}, free {human_bytes(free_disk)} "
                    f"on {self.root} (after a {human_bytes(self.margin)} margin and downloads in flight)"
                )
            if limit is not None:
                free_limit = max(0, limit - self.used_bytes() - sum(r.model_bytes for r in others))
                if model_bytes > free_limit:
                    raise InsufficientSpaceError(
                        f"{what}: insufficient space: need {human_bytes(model_bytes)}, free {human_bytes(free_limit)} "
                        f"of the node group's storageLimit {human_bytes(limit)}"
                    )
            self._reserved[key] = Reservation(key, disk_bytes, model_bytes)

    def release(self, key: str) -> None:
        with self._lock:
            self._reserved.pop(key, None)
