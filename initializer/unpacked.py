"""Remember that DEST holds an unpacked archive, so a restarted init container skips it.

The core pull's dest-mode manifest lists the archive it fetched; once the archive is unpacked
and deleted that manifest no longer matches the folder, and a rerun would fetch it again. This
record (kept by the store in DEST's bookkeeping folder) lists what the archive produced; when it matches
the folder and the manifest, the pair is complete and nothing touches the network.

Order for crash safety: unpack (merge into DEST) -> write this record -> delete the archive.
A crash before the record re-runs the (idempotent) unpack from the archive still in DEST;
a crash after it leaves at most the archive, which the next run deletes. When the pair is done
the record moves to an extended attribute of DEST and ``.modelcache`` goes (``finished``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from modelcache.archive import UnpackResult
from modelcache.diskio import fsync_tree
from modelcache.store import DestLayout, NodeStore

#: The store keeps it per storage key (pairs that share a DEST each keep theirs).
RECORD = "unpacked"


@dataclass(frozen=True)
class UnpackedRecord:
    storage_key: str
    archive: str
    archive_size: int
    files: list[tuple[str, int]]
    links: list[str]

    def to_json(self) -> str:
        return json.dumps(
            {
                "storage_key": self.storage_key,
                "archive": self.archive,
                "archive_size": self.archive_size,
                "files": [list(f) for f in self.files],
                "links": self.links,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> UnpackedRecord:
        doc = json.loads(text)
        return cls(
            storage_key=str(doc["storage_key"]),
            archive=str(doc["archive"]),
            archive_size=int(doc["archive_size"]),
            files=[(str(p), int(s)) for p, s in doc["files"]],
            links=[str(p) for p in doc["links"]],
        )


def build(dest: Path, key: str, archive: str, archive_size: int, result: UnpackResult) -> UnpackedRecord:
    files: list[tuple[str, int]] = []
    links: list[str] = []
    for rel in result.paths:
        st = os.lstat(dest / rel)
        if os.path.islink(dest / rel):
            links.append(rel)
        else:
            files.append((rel, st.st_size))
    return UnpackedRecord(key, archive, archive_size, files, links)


def write(dest: Path, record: UnpackedRecord) -> None:
    # The unpacker streams files without fsync: they are made durable first, or after a power
    # loss this record would vouch for files that are empty (sizes of 0 are caught, not every
    # file system's zeros).
    fsync_tree(dest, [rel for rel, _ in record.files] + record.links)
    NodeStore(DestLayout(dest)).write_record(RECORD, record.storage_key, record.to_json())


def load(dest: Path, key: str) -> UnpackedRecord | None:
    text = NodeStore(DestLayout(dest)).read_record(RECORD, key)
    if text is None:
        return None
    try:
        record = UnpackedRecord.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None
    return record if record.storage_key == key else None


def is_complete(dest: Path, record: UnpackedRecord) -> bool:
    """Every unpacked file still there with its size, every link still there (stats only)."""
    for rel, size in record.files:
        try:
            if os.lstat(dest / rel).st_size != size:
                return False
        except OSError:
            return False
    return all(os.path.islink(dest / rel) for rel in record.links)
