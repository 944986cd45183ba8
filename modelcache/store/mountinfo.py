"""The kernel's mount table (``/proc/<pid>/mountinfo``), parsed: one job, shared by the lock-scope
check (which file system a store root is on) and the in-use check (which mounts show a model
folder to a pod)."""

from __future__ import annotations

import os
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class Mount:
    device: str  # "major:minor" of the file system
    root: str  # the folder of that file system this mount shows (a bind mount's source)
    mount_point: str
    fstype: str
    source: str
    options: frozenset[str]  # per-mount and per-superblock options, "key=value" or flags

    def option(self, name: str) -> str | None:
        """The option's value ("" for a flag), or None if it is not set."""
        for o in self.options:
            if o == name:
                return ""
            if o.startswith(name + "="):
                return o.split("=", 1)[1]
        return None


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
        mounts.append(Mount(fields[2], _unescape(fields[3]), _unescape(fields[4]), tail[0], _unescape(tail[1]),
                            options))
    return mounts


def read_mountinfo(path: str | None = None) -> list[Mount]:
    """This process's mount table (or the one at ``path``); OSError if it cannot be read."""
    with open(path or MOUNTINFO) as f:
        return parse_mountinfo(f.read())


def mount_of(path: str | os.PathLike[str], mounts: list[Mount]) -> Mount | None:
    """The mount ``path`` lives on (the last-mounted one with the longest matching mount point)."""
    real = os.path.realpath(path)
    best: Mount | None = None
    best_len = -1
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        if (real == mp or real.startswith(mp + "/") or mp == "/") and len(mp) >= best_len:
            best, best_len = m, len(mp)
    return best


def fs_path(path: str | os.PathLike[str], mounts: list[Mount]) -> tuple[str, str] | None:
    """(device, path inside its file system) of ``path``: how other mount namespaces name it."""
    m = mount_of(path, mounts)
    if m is None:
        return None
    real = os.path.realpath(path)
    mp = m.mount_point.rstrip("/") or "/"
    rel = os.path.relpath(real, mp)
    inside = m.root if rel == "." else os.path.join(m.root, rel)
    return m.device, os.path.normpath(inside)
