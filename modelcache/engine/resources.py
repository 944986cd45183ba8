"""Limits of the engine's settings, checked before a pull starts instead of failing inside it.

A chunk size of one byte turns a gigabyte into a billion requests; one of 100G asks mmap for
terabytes of buffers and dies with a traceback. Every caller (the CLI's flags, the agent's
flags, the init container's environment) checks the same ranges here and names its own
setting in the one-line error.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from modelcache.errors import ModelcacheError
from modelcache.runtime.progress import human_bytes

#: Chunk sizes the engine accepts: below 64 KiB a request costs more than its bytes; above 1 GiB
#: the buffers ((workers + spares) x chunk) outgrow any init container's memory.
MIN_CHUNK = 64 << 10
MAX_CHUNK = 1 << 30


class ResourceError(ModelcacheError):
    """A setting out of its range, or more memory than the machine (or cgroup) has."""

    reason = "InvalidSetting"


def chunk_size_problem(size: int) -> str | None:
    """Why ``size`` is not an acceptable chunk size, or None."""
    if MIN_CHUNK <= size <= MAX_CHUNK:
        return None
    return f"{human_bytes(size)} is outside the allowed range {human_bytes(MIN_CHUNK)} to {human_bytes(MAX_CHUNK)}"


def available_memory() -> int | None:
    """Bytes this process may still use: the lower of the machine's MemAvailable and what the
    cgroup (a pod's memory limit) leaves; None when neither can be read."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError, ValueError):
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int((cg / "memory.current").read_text().strip())))
    return min(found) if found else None


def buffer_bytes(streams: int, chunk_size: int, spares: int | None = None) -> int:
    """The engine's buffer memory at its peak: (streams + spares) x chunk (spares: streams // 2)."""
    return (streams + (spares if spares is not None else max(1, streams // 2))) * chunk_size


def check_buffers(streams: int, chunk_size: int, settings: str, models: int = 1) -> None:
    """Refuse, in one line naming ``settings`` (e.g. "--workers 8 x --chunk-size 1G"), buffers
    that the memory left to this process cannot hold."""
    need = buffer_bytes(streams, chunk_size) * max(1, models)
    have = available_memory()
    if have is not None and need > have:
        times = f" x {models} models at once" if models > 1 else ""
        raise ResourceError(
            f"{settings}{times} needs {human_bytes(need)} of transfer buffers ((workers + workers/2) x chunk "
            f"size), but only {human_bytes(have)} of memory is available; lower the chunk size or the workers"
        )
