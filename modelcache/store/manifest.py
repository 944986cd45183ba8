"""What the store records of a published model: its manifest (sealed), and the checks of a
file or a folder against it.

A manifest is never trusted as one when damaged: ``Manifest.from_json`` refuses anything
malformed, and its paths never name anything outside the model folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from modelcache.sources.integrity import hash_file

#: 2: the manifest carries ``seal``, a digest of all its other fields (1, unsealed, is still read).
MANIFEST_VERSION = 2


@dataclass(frozen=True)
class ManifestFile:
    path: str
    size: int
    xxh3: str
    checksums: dict[str, str] = field(default_factory=dict)  # source checksums the bytes matched
    #: The source's version of the file when it was listed (ETag, generation, Last-Modified,
    #: commit): what a drift check compares when the source offers no checksum to compare.
    version: str | None = None


@dataclass(frozen=True)
class Manifest:
    storage_key: str
    uri: str  # redacted: no query strings or userinfo
    resolved_uri: str
    revision: str | None
    files: list[ManifestFile]
    created_at: str
    version: int = MANIFEST_VERSION
    #: Files kept on their size alone when a folder someone else filled was adopted and the source
    #: gives no checksum: nothing compared their bytes with the source's (``ls`` says "unverified").
    unverified: list[str] = field(default_factory=list)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        doc = asdict(self)
        for f in doc["files"]:
            if f.get("version") is None:
                f.pop("version", None)  # the manifests of sources without versions stay as they were
        if not doc["unverified"]:
            del doc["unverified"]  # (as are those of models verified whole)
        doc["seal"] = seal_of(doc)
        return json.dumps(doc, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, sealed: bool = True) -> Manifest:
        """Parse and check a manifest; anything malformed is a ValueError (the model then is not
        present): a damaged manifest is never trusted as one, and its paths never name anything
        outside the model folder. ``sealed=False`` reads a manifest whose seal does not match (the
        store's record of a folder it knew: its digests decide which files are kept, never sizes)."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("files"), list):
            raise ValueError("not a manifest")
        # Any damage to a sealed manifest (a flipped digit of a size or digest) is caught here;
        # a manifest of version 1 predates the seal and is only checked field by field.
        seal = data.pop("seal", None)
        if sealed and (seal is not None or data.get("version") != 1) and seal != seal_of(data):
            raise ValueError("manifest seal does not match its contents")
        files = [_manifest_file(f) for f in data.pop("files")]
        for name in ("storage_key", "uri", "resolved_uri", "created_at"):
            if not isinstance(data.get(name), str):
                raise ValueError(f"manifest field {name!r} is not a string")
        if not (data.get("revision") is None or isinstance(data["revision"], str)):
            raise ValueError("manifest field 'revision' is not a string")
        if data.get("version") not in (1, MANIFEST_VERSION):
            raise ValueError(f"manifest version {data.get('version')!r} is not 1 or {MANIFEST_VERSION}")
        if len({f.path for f in files}) != len(files):
            raise ValueError("manifest lists a path twice")
        unverified = data.pop("unverified", [])
        if not isinstance(unverified, list) or not all(isinstance(u, str) for u in unverified) \
                or not set(unverified) <= {f.path for f in files}:
            raise ValueError("manifest field 'unverified' is not a list of its files")
        return cls(files=files, unverified=unverified, **data)


_XXH3_HEX = re.compile(r"[0-9a-f]{32}")


def seal_of(doc: dict[str, object]) -> str:
    """A digest of a JSON document's fields but ``seal``: what a sealed record carries."""
    canonical = json.dumps({k: v for k, v in doc.items() if k != "seal"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _manifest_file(doc: object) -> ManifestFile:
    if not isinstance(doc, dict) or set(doc) - {"path", "size", "xxh3", "checksums", "version"}:
        raise ValueError("manifest file entry is not an object of path, size, xxh3, checksums, version")
    path, size, xxh3 = doc.get("path"), doc.get("size"), doc.get("xxh3")
    version = doc.get("version")
    if version is not None and not isinstance(version, str):
        raise ValueError(f"manifest version of {path!r} is not a string")
    checksums = doc.get("checksums", {})
    if not isinstance(path, str) or not path or "\x00" in path or "\\" in path:
        raise ValueError(f"manifest path {path!r} is not a file name")
    if path.startswith("/") or posixpath.normpath(path) != path or path == ".." or path.startswith("../"):
        raise ValueError(f"manifest path {path!r} is not a relative path inside the model")
    if type(size) is not int or size < 0:
        raise ValueError(f"manifest size {size!r} of {path!r} is not a byte count")
    if not isinstance(xxh3, str) or not _XXH3_HEX.fullmatch(xxh3):
        raise ValueError(f"manifest xxh3 of {path!r} is not a 128-bit hex digest")
    if not isinstance(checksums, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in checksums.items()):
        raise ValueError(f"manifest checksums of {path!r} are not names and values")
    return ManifestFile(path=path, size=size, xxh3=xxh3, checksums=checksums, version=version)


def read_manifest(path: Path, key: str, sealed: bool = True) -> Manifest | None:
    """The manifest of model ``key`` at ``path``, or None (missing, unreadable, malformed, or
    another model's)."""
    try:
        m = Manifest.from_json(path.read_text(), sealed=sealed)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return m if m.storage_key == key else None


def file_matches(path: Path, want: ManifestFile) -> bool:
    """The file at ``path`` is ``want``: a regular file (no link) of its size and xxh3."""
    try:
        st = path.lstat()
    except OSError:
        return False
    if not os.path.isfile(path) or os.path.islink(path) or st.st_size != want.size:
        return False
    return hash_file(path, size=st.st_size).local_hexdigest() == want.xxh3


@dataclass(frozen=True)
class VerifyProblem:
    path: str
    problem: str


def problems(base: Path, m: Manifest) -> list[VerifyProblem]:
    """Re-hash every file of ``m`` under ``base`` and say how each differs (missing, size, digest)."""
    found = []
    for f in m.files:
        p = base / f.path
        try:
            size = p.stat().st_size
        except OSError:
            found.append(VerifyProblem(f.path, "missing"))
            continue
        if size != f.size:
            found.append(VerifyProblem(f.path, f"size {size}, manifest says {f.size}"))
            continue
        digest = hash_file(p, size=size).local_hexdigest()
        if digest != f.xxh3:
            found.append(VerifyProblem(f.path, f"xxh3-128 {digest}, manifest says {f.xxh3}"))
    return found
