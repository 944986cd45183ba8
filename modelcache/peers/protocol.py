"""The peer protocol: two ranged-GET endpoints over TLS, every request with a bearer token.

``GET /v1/models/<storageKey>/<listingDigest>/have?epoch=E&since=N&wait=S``
    What the node holds of that model: a JSON :class:`HaveReply`. With the epoch and sequence
    number of an earlier reply it lists only what was added since (a long poll: the answer waits
    up to ``wait`` seconds for something new). A new epoch (the node restarted the download, or
    fetches a file again) means: forget what the last replies said.

``GET /v1/models/<storageKey>/<listingDigest>/files/<n>`` with ``Range: bytes=a-b``
    Bytes of file ``n`` (files numbered in path order) from pieces the node holds: 206 with
    ``Content-Range``. 404: not held (any more); 503 + ``Retry-After``: every upload slot busy.

Every request carries ``Authorization: Bearer <token>`` (401 without a valid one, 403 for a
valid identity that is not an agent). Nothing a peer sends is trusted: replies are parsed
strictly here, and every piece is checked against its sha-256 by the receiver.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from modelcache.peers.pieces import valid_digest, valid_hash

PREFIX = "/v1/models/"
#: Longest long poll a server holds (clients ask for less).
MAX_WAIT = 10.0
_PATH = re.compile(r"^/v1/models/([0-9a-f]{16})/([0-9a-f]{32})/(have|files/(\d{1,9}))$")
_RANGE = re.compile(r"^bytes=(\d{1,15})-(\d{1,15})$")


@dataclass(frozen=True)
class Route:
    storage_key: str
    digest: str
    kind: str  # "have" | "file"
    file: int = -1


def parse_path(path: str) -> Route | None:
    m = _PATH.fullmatch(path)
    if m is None:
        return None
    if m.group(3) == "have":
        return Route(m.group(1), m.group(2), "have")
    return Route(m.group(1), m.group(2), "file", int(m.group(4)))


def have_path(key: str, digest: str) -> str:
    return f"{PREFIX}{key}/{digest}/have"


def file_path(key: str, digest: str, file: int) -> str:
    return f"{PREFIX}{key}/{digest}/files/{file}"


def parse_range(value: str | None) -> tuple[int, int] | None:
    """One ``bytes=a-b`` range as [a, b+1); None for anything else (no suffix or multi-ranges)."""
    m = _RANGE.fullmatch((value or "").strip())
    if m is None:
        return None
    start, last = int(m.group(1)), int(m.group(2))
    return (start, last + 1) if last >= start else None


@dataclass(frozen=True)
class Geometry:
    """How a model is cut: the piece size, and the piece count of each file in path order."""

    piece_size: int
    counts: tuple[int, ...]

    @property
    def pieces(self) -> int:
        return sum(self.counts)


def max_have_bytes(pieces: int) -> int:
    """The largest ``have`` reply a model of ``pieces`` pieces can need: each piece listed once
    (``[f,p,"<64 hex>",o],``: at most 96 bytes with 9-digit indices) and claimed once, plus the
    envelope. A larger reply is refused before it is read."""
    return 4096 + pieces * (96 + 24)


@dataclass
class HaveReply:
    """What a node holds of one model. ``pieces``: (file, piece, sha-256 hex, read from the origin
    by this node); ``fetching``: pieces it reads from the origin right now (others wait for them
    instead of reading them too)."""

    epoch: str
    seq: int
    piece_size: int
    complete: bool = False
    #: True: ``pieces`` is everything (a new epoch or a first poll); False: what came after ``since``.
    full: bool = True
    pieces: list[tuple[int, int, str, bool]] = field(default_factory=list)
    fetching: list[tuple[int, int]] = field(default_factory=list)

    def to_json(self) -> bytes:
        return json.dumps({
            "epoch": self.epoch, "seq": self.seq, "pieceSize": self.piece_size, "complete": self.complete,
            "full": self.full, "pieces": [[f, p, h, int(o)] for f, p, h, o in self.pieces],
            "fetching": [[f, p] for f, p in self.fetching],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, body: bytes, geometry: Geometry) -> HaveReply:
        """Strict: a malformed reply is a ValueError (the peer is then not used). ``geometry``
        (ours) bounds every index: a peer cannot make us hold more entries than the model has
        pieces. A reply in another piece size is returned without its pieces (the caller refuses
        the peer: its pieces are not ours)."""
        doc: Any = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("have reply is not an object")
        epoch, seq, size = doc.get("epoch"), doc.get("seq"), doc.get("pieceSize")
        if not isinstance(epoch, str) or not 0 < len(epoch) <= 64 or type(seq) is not int or seq < 0:
            raise ValueError("have reply without epoch or sequence")
        if type(size) is not int or size <= 0:
            raise ValueError("have reply without a piece size")
        complete, full = doc.get("complete") is True, doc.get("full") is not False
        if size != geometry.piece_size:
            return cls(epoch, seq, size, complete, full)
        counts = geometry.counts
        pieces: list[tuple[int, int, str, bool]] = []
        for item in _list(doc.get("pieces")):
            if (not isinstance(item, list) or len(item) != 4 or not _piece(item[0], item[1], counts)
                    or not isinstance(item[2], str) or not valid_hash(item[2]) or item[3] not in (0, 1)):
                raise ValueError(f"have reply piece {str(item)[:200]} is malformed")
            pieces.append((item[0], item[1], item[2], bool(item[3])))
        fetching: list[tuple[int, int]] = []
        for item in _list(doc.get("fetching")):
            if not isinstance(item, list) or len(item) != 2 or not _piece(item[0], item[1], counts):
                raise ValueError(f"have reply claim {str(item)[:200]} is malformed")
            fetching.append((item[0], item[1]))
        return cls(epoch, seq, size, complete, full, pieces, fetching)


def _list(value: object) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError("have reply field is not a list")
    return value


def _piece(file: object, piece: object, counts: Sequence[int]) -> bool:
    return type(file) is int and 0 <= file < len(counts) and type(piece) is int and 0 <= piece < counts[file]


def check_key_digest(key: str, digest: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-f]{16}", key)) and valid_digest(digest)
