"""Drift: does a stored model still match its source? Answered from a listing, without a download.

A cached model is never compared with its source by a plain pull (that would cost a listing on
every cache hit), so after the source changes (a branch moved, an object overwritten) the node
keeps serving the old bytes. ``compare`` holds a fresh listing against the model's manifest:
per file, sizes, then the checksums both sides know (sha256, md5 / ETags, crc32c, ...), then
the source's version (generation, ETag, Last-Modified, commit) where no checksum is shared.
A file with equal size and nothing else to compare is "unknown", never silently "current"; so is
a file adopted on its size alone (the manifest's ``unverified``), which a refresh fetches again.

Used by ``modelcache pull --check`` (report), ``pull --refresh`` (which files to fetch again:
``Drift.keep`` are carried over) and the agent's periodic drift check (status detail).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from modelcache.runtime.progress import human_bytes
from modelcache.sources.base import RemoteFile
from modelcache.store import Manifest, ManifestFile

CURRENT = "current"  # every file matches the source
CHANGED = "changed"  # files differ, were added or removed
UNKNOWN = "unknown"  # nothing differs that can be seen, but some files offer nothing to compare
PINNED = "pinned"  # the URI names an immutable revision: it cannot drift
ERROR = "error"  # the source could not be listed
#: ManifestFile.version of a file an adoption kept as found although it differs from the listing
#: (modelcache.adopt, AS_FOUND): it never equals a source's version, and the file is reported
#: changed until a refresh replaces it.
KEPT_AS_FOUND = "kept-as-found"


@dataclass(frozen=True)
class Drift:
    storage_key: str
    uri: str
    state: str
    #: Files whose content differs from the stored one, added to or gone from the source.
    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    #: Same size and nothing else to compare them by.
    unknown: tuple[str, ...] = ()
    #: Files that match the source: what a refresh carries over instead of fetching.
    keep: tuple[str, ...] = ()
    stored_revision: str | None = None
    source_revision: str | None = None
    #: One line on what differs (or why it cannot be told).
    message: str = ""
    details: tuple[str, ...] = field(default=(), compare=False)

    @property
    def drifted(self) -> bool:
        return self.state == CHANGED


def compare_file(stored: ManifestFile, remote: RemoteFile) -> tuple[bool | None, str]:
    """(same?, why): True same, False differs, None cannot tell. ``why`` names what differs."""
    if stored.version == KEPT_AS_FOUND:
        return False, "kept as found when the folder was adopted (differs from the source)"
    if remote.size is not None and remote.size != stored.size:
        return False, f"size {stored.size} -> {remote.size}"
    shared = [c for c in remote.checksums if c.algo in stored.checksums]
    if shared:
        for c in shared:
            if c.value != stored.checksums[c.algo]:
                return False, f"{c.algo} {stored.checksums[c.algo][:12]} -> {c.value[:12]}"
        return True, ""
    if stored.version is not None and remote.version is not None:
        return (True, "") if stored.version == remote.version else (False, "version changed")
    return None, "same size, no checksum or version to compare"


def compare(manifest: Manifest, files: Sequence[RemoteFile], revision: str | None) -> Drift:
    """A fresh listing (``files``, pinned to ``revision`` where the source has one) against what
    the store holds."""
    common: dict[str, Any] = {"storage_key": manifest.storage_key, "uri": manifest.uri,
              "stored_revision": manifest.revision, "source_revision": revision}
    if manifest.revision and revision == manifest.revision and not manifest.unverified:
        # An immutable revision (a commit, a digest) that did not move: nothing else can differ.
        return Drift(state=CURRENT, keep=tuple(f.path for f in manifest.files), message="up to date", **common)
    remote = {f.path: f for f in files}
    stored = {f.path: f for f in manifest.files}
    changed, unknown, keep, details = [], [], [], []
    unverified = set(manifest.unverified)
    for path in sorted(stored.keys() & remote.keys()):
        # Adopted on its size alone: nothing ever compared its bytes with the source's.
        same, why = (None, "") if path in unverified else compare_file(stored[path], remote[path])
        if same is True:
            keep.append(path)
        elif same is False:
            changed.append(path)
            details.append(f"{path}: {why}")
        else:
            unknown.append(path)
    added = sorted(remote.keys() - stored.keys())
    removed = sorted(stored.keys() - remote.keys())
    moved = bool(manifest.revision and revision and revision != manifest.revision)
    parts = []
    if moved:
        parts.append(f"revision {manifest.revision} -> {revision}")
    if changed:
        parts.append(f"{len(changed)} changed ({', '.join(details[:3])}{', ...' if len(details) > 3 else ''})")
    if added:
        size = sum(remote[p].size or 0 for p in added)
        parts.append(f"{len(added)} added ({', '.join(added[:3])}{', ...' if len(added) > 3 else ''}; "
                     f"{human_bytes(size)})")
    if removed:
        parts.append(f"{len(removed)} removed ({', '.join(removed[:3])}{', ...' if len(removed) > 3 else ''})")
    if changed or added or removed:
        state = CHANGED
        message = "; ".join(parts)
    elif unknown:
        state = UNKNOWN
        adopted = [p for p in unknown if p in unverified]
        if adopted:
            message = (f"{len(adopted)} file(s) unverified ({', '.join(adopted[:3])}: adopted on their size alone, "
                       "the source gives no checksum; a refresh fetches them again)")
        else:
            message = (f"{len(unknown)} file(s) cannot be compared ({', '.join(unknown[:3])}: the source gives no "
                       "checksum or version for them and their sizes match)")
        if moved:
            message = f"revision {manifest.revision} -> {revision}; {message}"
    else:
        state = CURRENT
        message = (f"up to date (revision {manifest.revision} -> {revision}, every file the same)" if moved
                   else "up to date")
    return Drift(state=state, changed=tuple(changed), added=tuple(added), removed=tuple(removed),
                 unknown=tuple(unknown), keep=tuple(keep), message=message, details=tuple(details), **common)
