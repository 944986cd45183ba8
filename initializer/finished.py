"""A finished init container leaves DEST holding exactly the model: no bookkeeping folder.

Runtimes read DEST as a model repository, and some take every sub-directory for a model: Triton
polls each one (``.modelcache`` included: it skips only ``.`` and ``..``) and, with its default
``--exit-on-error``, does not start when one fails to load. So while a pair runs, its staging,
journal and lock live in ``DEST/.modelcache`` (a restarted container resumes from there, and
nothing serves DEST yet); once the pair succeeded that folder is removed.

That DEST is complete is then kept where no runtime looks: an extended attribute of DEST itself
(``user.modelcache.<storageKey>``, the files, sizes and sampled fingerprints the pair produced,
compressed). A rerun (the pod restarted) finds it and checks each file without a request: its
size, that it has no holes, its fingerprint (1 MiB read per file), and, when the URI pins a
digest (``#sha256=``), the whole file against the pin (``unpacked.problems``). Files that fail
are deleted (they are ours and wrong) and the pair runs again. Where the file system keeps no
user xattrs (tmpfs before Linux 6.6) or the list is too large for one, a rerun lists the source
and adopts what DEST holds (``modelcache.adopt``): no download either, except for an archive,
whose contents cannot be checked without fetching it again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import zlib
from pathlib import Path

from initializer.unpacked import UnpackedRecord, with_prints
from modelcache.store import DestStore, Manifest

XATTR_PREFIX = "user.modelcache."
#: Errors that mean "no xattr here": not supported, no space in the inode, value too large.
_NO_XATTR = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSPC, errno.E2BIG, errno.ERANGE, errno.EPERM, errno.EACCES}


def _name(key: str) -> str:
    return XATTR_PREFIX + key


def from_manifest(dest: Path, manifest: Manifest) -> UnpackedRecord:
    return with_prints(dest, UnpackedRecord(manifest.storage_key, "", 0, [(f.path, f.size) for f in manifest.files],
                                            []))


def mark(dest: Path, record: UnpackedRecord) -> bool:
    """Record that DEST holds ``record``; False when the file system cannot keep it."""
    value = zlib.compress(record.to_json().encode(), 9)
    try:
        os.setxattr(dest, _name(record.storage_key), value)
    except OSError as exc:
        if exc.errno in _NO_XATTR:
            return False
        raise
    return True


def load(dest: Path, key: str) -> UnpackedRecord | None:
    try:
        record = UnpackedRecord.from_json(zlib.decompress(os.getxattr(dest, _name(key))).decode())
    except (OSError, ValueError, KeyError, TypeError, zlib.error):
        return None
    return record if record.storage_key == key else None


def forget(dest: Path, key: str) -> None:
    """Drop the record before DEST changes (a pair that runs again rewrites files)."""
    with contextlib.suppress(OSError):
        os.removexattr(dest, _name(key))


def finish(dest: Path, record: UnpackedRecord) -> bool:
    """The pair succeeded: record it, then remove the bookkeeping folder from DEST."""
    marked = mark(dest, record)
    DestStore.at(dest).clear_bookkeeping()
    return marked
