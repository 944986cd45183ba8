"""Pieces: the unit agents exchange, and the record of their hashes.

A model's files are cut into pieces of ``piece_size`` bytes (a file's last piece is shorter).
The node that reads a piece from the origin hashes it (sha-256) as the bytes pass to its
transfer engine; every node that receives the piece from a peer checks it against that hash
before one byte reaches its own engine. A node serves only pieces whose hash it holds and whose
bytes its engine has written.

Two records keep the hashes across restarts:

- ``<staging>/pieces``: append-only, one sealed line per hashed piece (``h <file> <piece> <hex>
  <o|p>``: read from the origin or from a peer), ``R <file>`` when a file is fetched again, a
  first line naming the piece size and the listing digest. A resumed download keeps its hashes.
- ``pieces.json`` next to the manifest (installed by ``NodeStore.publish``): every piece hash of
  the published model, the listing digest, and where its bytes came from. A published model is
  served to peers from it.

The **listing digest** names exactly what is being fetched: the resolved URI and every file's
path, size, version and source checksums. Agents exchange pieces only under the same digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from modelcache.sources.base import RemoteFile
from modelcache.store import seal_of
from modelcache.store.journal import seal, unseal

MiB = 1 << 20
#: Largest piece: what a receiver buffers per stream before it hands verified bytes on.
PIECE_MAX = 4 * MiB
PIECE_ALGO = "sha256"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(r"[0-9a-f]{32}")


def piece_size_for(chunk_size: int) -> int:
    """Pieces never straddle the engine's chunks: ``PIECE_MAX`` when it divides the chunk size,
    else the chunk itself (small chunks in tests, odd sizes)."""
    if chunk_size > PIECE_MAX and chunk_size % PIECE_MAX == 0:
        return PIECE_MAX
    return chunk_size


def piece_count(size: int, piece_size: int) -> int:
    return -(-size // piece_size)


def piece_span(size: int, piece_size: int, index: int) -> tuple[int, int]:
    start = index * piece_size
    return start, min(start + piece_size, size)


def hash_piece(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def listing_digest(resolved_uri: str, files: Iterable[RemoteFile]) -> str:
    """32 hex digits naming exactly what a download fetches (order of the listing ignored)."""
    doc = [resolved_uri, sorted(
        [f.path, f.size, f.version, sorted([c.algo, c.value, list(map(list, c.params))] for c in f.checksums)]
        for f in files)]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:32]


def valid_digest(value: str) -> bool:
    return bool(_DIGEST.fullmatch(value))


def valid_hash(value: str) -> bool:
    return bool(_HEX64.fullmatch(value))


@dataclass(frozen=True)
class PieceHash:
    hex: str
    origin: bool  # this node read the piece from the origin (else: from a peer, verified)


class PieceLog:
    """``<staging>/pieces``: the hashes of a staged download, one sealed line each."""

    def __init__(self, path: str, piece_size: int, digest: str) -> None:
        self.path = path
        self.header = f"pieces v1 {piece_size} {digest}"
        self._fd = -1

    def load(self) -> dict[tuple[int, int], PieceHash]:
        """Hashes an earlier run recorded for this piece size and listing; {} for anything else."""
        out: dict[tuple[int, int], PieceHash] = {}
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            return out
        lines = [unseal(ln) for ln in text.split("\n")[:-1]]  # the last, unterminated one may be torn
        if not lines or lines[0] != self.header:
            return {}
        for line in lines[1:]:
            parts = (line or "").split(" ")
            try:
                if parts[0] == "h" and len(parts) == 5 and valid_hash(parts[3]) and parts[4] in ("o", "p"):
                    out[(int(parts[1]), int(parts[2]))] = PieceHash(parts[3], parts[4] == "o")
                elif parts[0] == "R" and len(parts) == 2:
                    idx = int(parts[1])
                    for key in [k for k in out if k[0] == idx]:
                        del out[key]
            except ValueError:
                continue
        return out

    def open(self, fresh: bool) -> None:
        if not fresh and self.load() == {} and not self._has_header():
            fresh = True
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0), 0o644)
        if fresh:
            self._append(self.header)
        else:
            os.write(self._fd, b"\n")  # ends a line torn by a crash; blank lines are skipped

    def _has_header(self) -> bool:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                return unseal(f.readline().rstrip("\n")) == self.header
        except OSError:
            return False

    def _append(self, line: str) -> None:
        if self._fd >= 0:
            try:
                os.write(self._fd, seal(line + "\n").encode())
            except OSError:
                # A full disk: the engine reports it for the data; a lost hash line only means the
                # piece is hashed again from disk when the model is published.
                os.close(self._fd)
                self._fd = -1

    def add(self, file_idx: int, piece: int, h: PieceHash) -> None:
        self._append(f"h {file_idx} {piece} {h.hex} {'o' if h.origin else 'p'}")

    def reset(self, file_idx: int) -> None:
        self._append(f"R {file_idx}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class PieceRecord:
    """Every piece hash of a published model (``pieces.json`` next to its manifest)."""

    storage_key: str
    listing_digest: str
    piece_size: int
    #: path -> the sha-256 of each of its pieces, in order.
    files: dict[str, list[str]]
    bytes_from_origin: int = 0
    bytes_from_peers: int = 0
    algo: str = PIECE_ALGO
    version: int = 1
    extra: dict[str, int] = field(default_factory=dict, compare=False)
    #: path -> one letter per piece: ``o`` this node read it from the origin (it witnesses its
    #: hash to others), ``p`` it came from a peer, checked. Absent (older records): all ``p``.
    sources: dict[str, str] = field(default_factory=dict)

    def from_origin(self, path: str, piece: int) -> bool:
        letters = self.sources.get(path, "")
        return piece < len(letters) and letters[piece] == "o"

    def to_json(self) -> str:
        doc = asdict(self)
        doc.pop("extra")
        doc["seal"] = seal_of(doc)
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PieceRecord:
        """Parse and check; anything malformed (or a broken seal) is a ValueError: never served."""
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("not a piece record")
        if doc.pop("seal", None) != seal_of(doc):
            raise ValueError("piece record seal does not match its contents")
        if doc.get("version") != 1 or doc.get("algo") != PIECE_ALGO:
            raise ValueError("unknown piece record version or hash")
        size, files = doc.get("piece_size"), doc.get("files")
        if type(size) is not int or size <= 0 or not isinstance(files, dict):
            raise ValueError("piece record without a piece size or files")
        for path, hashes in files.items():
            if not isinstance(path, str) or not isinstance(hashes, list) or not all(
                    isinstance(h, str) and valid_hash(h) for h in hashes):
                raise ValueError(f"piece record entry {path!r} is not a list of sha-256 digests")
        if not isinstance(doc.get("storage_key"), str) or not valid_digest(str(doc.get("listing_digest"))):
            raise ValueError("piece record without a storage key or listing digest")
        for name in ("bytes_from_origin", "bytes_from_peers"):
            if type(doc.get(name)) is not int:
                raise ValueError(f"piece record field {name} is not a byte count")
        sources = doc.get("sources", {})
        if not isinstance(sources, dict) or not all(
                isinstance(v, str) and set(v) <= {"o", "p"} and len(v) == len(files.get(k, ()))
                for k, v in sources.items()):
            raise ValueError("piece record sources are not one letter (o, p) per piece")
        return cls(**doc)
