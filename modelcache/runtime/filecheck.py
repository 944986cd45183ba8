"""Cheap checks that a file on disk is still the one recorded, for where hashing it whole is too
dear (an init container's rerun) or nothing else vouches for it (adoption without a checksum).

- ``has_holes``: a file with a hole was never written whole. ``truncate -s``, a preallocated
  file (``fallocate``: unwritten extents read as zeros and SEEK_HOLE reports them, ext4 and XFS
  through iomap), or a copy killed part-way leave one. A file the engine wrote has none.
- ``fingerprint``: xxh3-64 of the size and of 16 samples of 64 KiB spread over the file (the
  first and the last included): 1 MiB read per file, whatever its size. A zero-filled file, a
  copy that stopped part-way or a file replaced by another differs from its recorded
  fingerprint; a flipped byte between samples does not, which only a full hash catches.
"""

from __future__ import annotations

import os

import xxhash

SAMPLES = 16
SAMPLE = 64 << 10


def has_holes(path: str | os.PathLike[str]) -> bool:
    """The file has a hole (an unwritten range) before its end. A file system without
    SEEK_HOLE reports none (its end is the only hole): nothing is refused for that."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return False
        try:
            return os.lseek(fd, 0, os.SEEK_HOLE) < size
        except OSError:
            return False
    finally:
        os.close(fd)


def fingerprint(path: str | os.PathLike[str]) -> str:
    """16 hex digits: xxh3-64 of the size and the samples (the whole file below 1 MiB)."""
    h = xxhash.xxh3_64()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        h.update(size.to_bytes(8, "little"))
        if size <= SAMPLES * SAMPLE:
            offsets: list[int] = list(range(0, size, SAMPLE))
        else:  # evenly spread, the first at 0 and the last ending at the file's end
            offsets = [(size - SAMPLE) * i // (SAMPLES - 1) for i in range(SAMPLES)]
        for off in offsets:
            h.update(os.pread(fd, SAMPLE, off))
    finally:
        os.close(fd)
    return h.hexdigest()
