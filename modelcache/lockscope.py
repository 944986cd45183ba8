"""Whether ``flock`` on a store excludes writers on other hosts, from the mount table.

All of the store's mutual exclusion is ``flock`` on ``locks/<key>.lock``: one writer per model.
On a local disk only this host can write, so that is enough. On a file system other hosts mount
too, ``flock`` must reach the server: Linux NFS emulates it with POSIX locks the server
enforces, except with ``nolock`` or ``local_lock=flock|all``, where it is local to each client;
CIFS with ``nobrl`` keeps byte-range locks local; a FUSE file system's locks are the kernel's
own (local) unless its daemon implements them, which nothing here can tell. There, two hosts
pulling one model rmtree each other's staging and publish each other's half-written files, so
the store refuses to lock unless ``MODELCACHE_SINGLE_HOST_ROOT=1`` says only this host writes
it. Read-only uses (``ls``, ``verify``, a present model) take no lock and are never refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from modelcache.errors import StoreError

MOUNTINFO = "/proc/self/mountinfo"
#: Set to 1 where a root on such a file system is written by this host only.
SINGLE_HOST_ENV = "MODELCACHE_SINGLE_HOST_ROOT"


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    source: str
    options: frozenset[str]  # per-mount and per-superblock options, "key=value" or flags


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 3:
            continue
        options = frozenset(fields[5].split(",")) | frozenset(tail[2].split(","))
        mounts.append(Mount(_unescape(fields[4]), tail[0], _unescape(tail[1]), options))
    return mounts


def mount_of(path: str | os.PathLike[str], mountinfo: str | None = None) -> Mount | None:
    """The mount ``path`` lives on (the last-mounted one with the longest matching mount point)."""
    try:
        with open(mountinfo or MOUNTINFO) as f:
            mounts = parse_mountinfo(f.read())
    except OSError:
        return None
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        inside = real == mp or real.startswith(mp + "/") or mp == "/"
        if inside and (best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/")):
            best = m
    return best


def _option(options: frozenset[str], name: str) -> str | None:
    for o in options:
        if o == name:
            return ""
        if o.startswith(name + "="):
            return o.split("=", 1)[1]
    return None


def host_local_locks(m: Mount) -> str | None:
    """Why ``flock`` on this mount does not exclude other hosts that mount it too (None: it does,
    or only this host can mount it)."""
    fstype = m.fstype
    if fstype in ("nfs", "nfs4"):
        if _option(m.options, "nolock") is not None:
            return "it is NFS mounted with 'nolock'"
        local = _option(m.options, "local_lock")
        if local in ("flock", "all"):
            return f"it is NFS mounted with 'local_lock={local}'"
        return None
    if fstype in ("cifs", "smb3") and _option(m.options, "nobrl") is not None:
        return f"it is {fstype} mounted with 'nobrl'"
    if fstype == "fuse" or fstype.startswith("fuse."):
        return f"it is a FUSE file system ({fstype}), whose locks may be local to this host"
    return None


def check_exclusive(path: Path) -> None:
    """Raise unless a lock taken under ``path`` excludes every host that can write there."""
    if os.environ.get(SINGLE_HOST_ENV, "").lower() in ("1", "true", "yes"):
        return
    m = mount_of(path)
    reason = host_local_locks(m) if m is not None else None
    if reason:
        raise StoreError(
            f"refusing to write the store at '{path}': {reason}, so two hosts could write one model at "
            f"once and publish each other's half-written files; mount it with working locks, give each "
            f"host its own root, or set {SINGLE_HOST_ENV}=1 if only this host writes it"
        )
