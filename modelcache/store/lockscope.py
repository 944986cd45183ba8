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
from pathlib import Path

from modelcache.errors import StoreError
from modelcache.store import mountinfo
from modelcache.store.mountinfo import Mount

#: Set to 1 where a root on such a file system is written by this host only.
SINGLE_HOST_ENV = "MODELCACHE_SINGLE_HOST_ROOT"


def host_local_locks(m: Mount) -> str | None:
    """Why ``flock`` on this mount does not exclude other hosts that mount it too (None: it does,
    or only this host can mount it)."""
    fstype = m.fstype
    if fstype in ("nfs", "nfs4"):
        if m.option("nolock") is not None:
            return "it is NFS mounted with 'nolock'"
        local = m.option("local_lock")
        if local in ("flock", "all"):
            return f"it is NFS mounted with 'local_lock={local}'"
        return None
    if fstype in ("cifs", "smb3") and m.option("nobrl") is not None:
        return f"it is {fstype} mounted with 'nobrl'"
    if fstype == "fuse" or fstype.startswith("fuse."):
        return f"it is a FUSE file system ({fstype}), whose locks may be local to this host"
    return None


def check_exclusive(path: Path) -> None:
    """Raise unless a lock taken under ``path`` excludes every host that can write there."""
    if os.environ.get(SINGLE_HOST_ENV, "").lower() in ("1", "true", "yes"):
        return
    try:
        m = mountinfo.mount_of(path, mountinfo.read_mountinfo())
    except OSError:
        return  # no /proc (not Linux): nothing to tell
    reason = host_local_locks(m) if m is not None else None
    if reason:
        raise StoreError(
            f"refusing to write the store at '{path}': {reason}, so two hosts could write one model at "
            f"once and publish each other's half-written files; mount it with working locks, give each "
            f"host its own root, or set {SINGLE_HOST_ENV}=1 if only this host writes it"
        )
