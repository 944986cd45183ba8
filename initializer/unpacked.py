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

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from modelcache.runtime.filecheck import fingerprint, has_holes
from modelcache.sources.archive import UnpackResult
from modelcache.sources.integrity import hash_file
from modelcache.sources.remote import Checksum
from modelcache.store import DestStore, regular_file_inside
from modelcache.store.diskio import fsync_tree

#: The store keeps it per storage key (pairs that share a DEST each keep theirs).
RECORD = "unpacked"


@dataclass(frozen=True)
class UnpackedRecord:
    storage_key: str
    archive: str
    archive_size: int
    files: list[tuple[str, int]]
    links: list[str]
    #: Each file's sampled fingerprint (``modelcache.runtime.filecheck``), in ``files``' order; empty in
    #: records written before there were any (sizes and holes are checked then).
    prints: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        doc: dict[str, object] = {
            "storage_key": self.storage_key,
            "archive": self.archive,
            "archive_size": self.archive_size,
            "files": [list(f) for f in self.files],
            "links": self.links,
        }
        if self.prints:
            doc["prints"] = self.prints
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str) -> UnpackedRecord:
        doc = json.loads(text)
        record = cls(
            storage_key=str(doc["storage_key"]),
            archive=str(doc["archive"]),
            archive_size=int(doc["archive_size"]),
            files=[(str(p), int(s)) for p, s in doc["files"]],
            links=[str(p) for p in doc["links"]],
            prints=[str(p) for p in doc.get("prints", [])],
        )
        if record.prints and len(record.prints) != len(record.files):
            raise ValueError("fingerprints do not match the files")
        return record


def with_prints(dest: Path, record: UnpackedRecord) -> UnpackedRecord:
    """``record`` with the fingerprint of each of its files as DEST holds them now."""
    return dataclasses.replace(record, prints=[fingerprint(dest / rel) for rel, _ in record.files])


def build(dest: Path, key: str, archive: str, archive_size: int, result: UnpackResult) -> UnpackedRecord:
    files: list[tuple[str, int]] = []
    links: list[str] = []
    for rel in result.paths:
        st = os.lstat(dest / rel)
        if os.path.islink(dest / rel):
            links.append(rel)
        else:
            files.append((rel, st.st_size))
    return with_prints(dest, UnpackedRecord(key, archive, archive_size, files, links))


def write(dest: Path, record: UnpackedRecord) -> None:
    # The unpacker streams files without fsync: they are made durable first, or after a power
    # loss this record would vouch for files that are empty (sizes of 0 are caught, not every
    # file system's zeros).
    fsync_tree(dest, [rel for rel, _ in record.files] + record.links)
    DestStore.at(dest).write_record(RECORD, record.storage_key, record.to_json())


def load(dest: Path, key: str) -> UnpackedRecord | None:
    text = DestStore.at(dest).read_record(RECORD, key)
    if text is None:
        return None
    try:
        record = UnpackedRecord.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None
    return record if record.storage_key == key else None


def problems(dest: Path, record: UnpackedRecord, pin: tuple[str, str] | None = None) -> list[str]:
    """The files of ``record`` that DEST no longer holds as recorded (empty: complete), without a
    request to the source: each file there, a regular file (no link on the way) of its size,
    without holes (a preallocated, zero-filled or cut copy), and with its sampled fingerprint.
    A URI that pins its file's digest (``#sha256=``) has that file hashed whole against the pin:
    the one check that catches any changed byte, which the user asked for by pinning.
    A link the record lists that is gone counts as a problem too (its name)."""
    bad = []
    for i, (rel, size) in enumerate(record.files):
        st = regular_file_inside(dest, rel)
        if st is None or st.st_size != size or has_holes(dest / rel) or (
                record.prints and fingerprint(dest / rel) != record.prints[i]):
            bad.append(rel)
    if pin is not None and not record.archive and len(record.files) == 1 and not bad:
        rel, size = record.files[0]
        if hash_file(dest / rel, [Checksum(*pin)], size=size).mismatches():
            bad.append(rel)
    return bad + [rel for rel in record.links if not os.path.islink(dest / rel)]
