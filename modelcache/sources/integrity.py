"""Checksums: a registry of incremental hashers by algorithm name, and file verification.

Every file gets an xxh3-128 digest in its manifest (fast, GIL-free, used by ``verify``); a
file is also checked against every checksum its source vouches for (``RemoteFile.checksums``).
Backends add algorithms with ``@register_hasher``; values are lower-case hex throughout.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import zlib
from collections.abc import Callable, Iterable
from typing import Protocol

import xxhash

from modelcache.sources.remote import Checksum

LOCAL_ALGO = "xxh3-128"
_READ_BLOCK = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


HasherFactory = Callable[[Checksum, int | None], Hasher]
_HASHERS: dict[str, HasherFactory] = {}
_CRYPTOGRAPHIC: set[str] = set()


def register_hasher(algo: str, cryptographic: bool = False) -> Callable[[HasherFactory], HasherFactory]:
    """``cryptographic``: no one can make other bytes with the same digest (sha-2, sha-1, md5 and
    what is built on them); CRCs and xxh3 are not, whoever knows the file can forge one."""

    def deco(factory: HasherFactory) -> HasherFactory:
        _HASHERS[algo] = factory
        if cryptographic:
            _CRYPTOGRAPHIC.add(algo)
        return factory

    return deco


def supported(algo: str) -> bool:
    return algo in _HASHERS


def cryptographic(algo: str) -> bool:
    """Whether a digest of ``algo`` also holds against someone who forges bytes on purpose (a
    lying peer): only then does a file's source checksum settle what peers sent (peers.md)."""
    return algo in _CRYPTOGRAPHIC


def new_hasher(checksum: Checksum, size: int | None) -> Hasher:
    return _HASHERS[checksum.algo](checksum, size)


def _hashlib(name: str) -> HasherFactory:
    return lambda _c, _s: hashlib.new(name)


# Second preimages: none known even for md5 and sha1 (their collisions need both files chosen).
for _name in ("sha256", "sha1", "md5", "sha512"):
    register_hasher(_name, cryptographic=True)(_hashlib(_name))


@register_hasher(LOCAL_ALGO)
def _xxh3(_c: Checksum, _s: int | None) -> Hasher:
    return xxhash.xxh3_128()


@register_hasher("git-blob-sha1", cryptographic=True)
def _git_blob(_c: Checksum, size: int | None) -> Hasher:
    """Git's object id of a file: sha1 over ``blob <size>\\0`` + content (HF small files)."""
    if size is None:
        raise ValueError("git-blob-sha1 needs the file size up front")
    h = hashlib.sha1()
    h.update(b"blob %d\0" % size)
    return h


try:  # ISA-L's CRC32 runs ~12 GiB/s here against ~2.5 for zlib's (S3's default checksum)
    from isal.isal_zlib import crc32 as _crc32_impl
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the same function, slower
    _crc32_impl = zlib.crc32


class _Crc32:
    def __init__(self) -> None:
        self._v = 0

    def update(self, data: bytes | memoryview, /) -> None:
        self._v = _crc32_impl(data, self._v)

    def hexdigest(self) -> str:
        return f"{self._v:08x}"


register_hasher("crc32")(lambda c, s: _Crc32())


class _Crc32c:
    def __init__(self) -> None:
        import google_crc32c

        self._h = google_crc32c.Checksum()

    def update(self, data: bytes | memoryview, /) -> None:
        # The C extension accepts only bytes (not even a read-only memoryview): copy.
        self._h.update(data if isinstance(data, bytes) else bytes(data))

    def hexdigest(self) -> str:
        return self._h.digest().hex()


register_hasher("crc32c")(lambda c, s: _Crc32c())


class _S3MultipartEtag:
    """S3's multipart ETag: md5 of the concatenated per-part md5s, then ``-<parts>``."""

    def __init__(self, part_size: int) -> None:
        self._part_size = part_size
        self._digests: list[bytes] = []
        self._cur = hashlib.md5()
        self._in_part = 0

    def update(self, data: bytes | memoryview, /) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self._part_size - self._in_part)
            self._cur.update(view[:take])
            self._in_part += take
            view = view[take:]
            if self._in_part == self._part_size:
                self._digests.append(self._cur.digest())
                self._cur = hashlib.md5()
                self._in_part = 0

    def hexdigest(self) -> str:
        digests = list(self._digests)
        if self._in_part or not digests:
            digests.append(self._cur.digest())
        return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


@register_hasher("s3-etag", cryptographic=True)
def _s3_etag(c: Checksum, _s: int | None) -> Hasher:
    part = int(c.param("part_size", "0"))
    if part <= 0:
        raise ValueError("s3-etag needs a part_size parameter")
    return _S3MultipartEtag(part)


def b64_to_hex(value: str) -> str:
    """Digest headers carry base64; checksums here are hex."""
    return base64.b64decode(value.strip(), validate=True).hex()


def safe_b64_to_hex(value: str | bytes | bytearray | None) -> str | None:
    """A base64 digest (HTTP headers, object-store metadata) as hex; None if absent or malformed.
    Raw digest bytes (some SDKs decode for us) are taken as they are."""
    if value is None or value == "":
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    try:
        return b64_to_hex(value)
    except (binascii.Error, ValueError):
        return None


class MultiHasher:
    """Feeds one byte stream to the local digest and every verifiable source checksum."""

    def __init__(self, checksums: Iterable[Checksum], size: int | None) -> None:
        self.expected = [c for c in checksums if supported(c.algo)]
        self._local = xxhash.xxh3_128()
        self._hashers = [new_hasher(c, size) for c in self.expected]

    def update(self, data: bytes | memoryview) -> None:
        self._local.update(data)
        for h in self._hashers:
            h.update(data)

    def local_hexdigest(self) -> str:
        return self._local.hexdigest()

    def mismatches(self) -> list[tuple[Checksum, str]]:
        """(expected, actual) for every source checksum the bytes do not match."""
        out = []
        for c, h in zip(self.expected, self._hashers, strict=True):
            actual = h.hexdigest()
            if actual.lower() != c.value.lower():
                out.append((c, actual))
        return out


def hash_file(path: str | os.PathLike[str], checksums: Iterable[Checksum] = (), size: int | None = None) -> MultiHasher:
    """Hash a whole file from disk (verify, resume), reading in large blocks."""
    if size is None:
        size = os.path.getsize(path)
    mh = MultiHasher(checksums, size)
    buf = bytearray(_READ_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            mh.update(view[:n])
    return mh
