"""Which mounts on this node show a model folder: the CLI's check before it replaces or deletes one.

A serving pod reads a cached model through a volume mount with ``subPath: models/<storageKey>``;
the kubelet makes that a bind mount of the folder (under ``/var/lib/kubelet/pods/...``), and the
container's mount namespace holds another. Replacing the folder (a publish swaps it) or deleting
it leaves such a pod on a deleted, empty directory. The agent asks the Kubernetes API which pods
use a model (``agent/inuse.py``); the CLI does not talk to the API, so it looks at the node
itself: every mount namespace's ``/proc/<pid>/mountinfo``, for a mount whose source is the
folder or a path inside it on the same file system.

It cannot see everything when it runs in its own PID namespace (a container without
``hostPID``), or without the right to read the mount tables of the processes of pods (not root).
It then says so and refuses, unless told to assume no pod uses the model. A process that is not
in a pod's cgroup (``kubepods`` in ``/proc/<pid>/cgroup``, which anyone may read, under either
kubelet cgroup driver) is not counted when it cannot be read: it cannot hold a pod's mount. (On
some machines even root may not read PID 1's mount namespace; the earlier rule, any unreadable
process on a machine with a /var/lib/kubelet, refused every rm there once a kubelet had run.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from modelcache.errors import ModelInUseError, StoreError
from modelcache.store.mountinfo import fs_path, parse_mountinfo, read_mountinfo

PROC = "/proc"
#: In the cgroup path of every process of a pod, under the cgroupfs and the systemd drivers alike.
POD_CGROUP = "kubepods"
_INIT_PID_NS = 0xEFFFFFFC  # the initial PID namespace's inode number (PROC_PID_INIT_INO)


@dataclass(frozen=True)
class MountUsers:
    mounts: list[str] = field(default_factory=list)  # "<mount point> (pid N)" per mount found
    unknown: str | None = None  # why some mounts could not be seen


def mount_users(folder: Path) -> MountUsers:
    """Mounts, in any mount namespace on this node, of ``folder`` or of anything inside it."""
    try:
        where = fs_path(folder, read_mountinfo())
    except OSError as exc:
        return MountUsers(unknown=f"cannot read this process's mount table ({exc.strerror})")
    if where is None:
        return MountUsers(unknown=f"no mount holds '{folder}'")
    device, inside = where
    try:
        own_pid_ns = os.stat(f"{PROC}/self/ns/pid").st_ino
    except OSError:
        own_pid_ns = _INIT_PID_NS
    unknown = None
    if own_pid_ns != _INIT_PID_NS:
        unknown = ("it runs in its own PID namespace (a container without hostPID), where the node's "
                   "pods and their mounts are not visible")
    found: list[str] = []
    seen: set[str] = set()
    denied = 0
    for pid in sorted((p for p in os.listdir(PROC) if p.isdigit()), key=int):
        try:
            ns = os.readlink(f"{PROC}/{pid}/ns/mnt")
            if ns in seen:
                continue
            with open(f"{PROC}/{pid}/mountinfo") as f:
                mounts = parse_mountinfo(f.read())
        except PermissionError:
            denied += _in_pod(pid)
            continue
        except OSError:
            continue  # the process ended meanwhile
        seen.add(ns)
        for m in mounts:
            root = os.path.normpath(m.root)
            if m.device == device and (root == inside or root.startswith(inside.rstrip("/") + "/")):
                found.append(f"{m.mount_point} (pid {pid})")
    if denied and unknown is None:
        unknown = f"the mounts of {denied} processes of pods on this node cannot be read (not root)"
    return MountUsers(found, unknown)


def _in_pod(pid: str) -> bool:
    try:
        with open(f"{PROC}/{pid}/cgroup") as f:
            return POD_CGROUP in f.read()
    except OSError:
        return False


def mount_guard(assume_unused: bool) -> Callable[[str, Path], None]:
    """The CLI's check before a model folder is replaced or deleted: refuse if a mount shows it
    (ModelInUseError: a pod uses it), or if that cannot be known (unless ``assume_unused``)."""

    def guard(key: str, folder: Path) -> None:
        users = mount_users(folder)
        if users.mounts:
            more = f" and {len(users.mounts) - 3} more" if len(users.mounts) > 3 else ""
            raise ModelInUseError(
                f"model {key} is mounted at {', '.join(users.mounts[:3])}{more}: a pod or container on this "
                "node uses it; stop it (or remove the model from its cache) first"
            )
        if users.unknown and not assume_unused:
            raise StoreError(
                f"model {key}: cannot tell whether a pod on this node mounts '{folder}': {users.unknown}; "
                "run as root on the node itself, or pass --assume-unused if no pod uses it"
            )

    return guard
