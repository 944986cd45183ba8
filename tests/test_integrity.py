"""Hashers: the checksums backends vouch for, computed incrementally in any split."""

from __future__ import annotations

import hashlib
import zlib

import pytest

from modelcache.sources.base import Checksum
from modelcache.sources.integrity import MultiHasher, b64_to_hex, hash_file, new_hasher

DATA = bytes(range(256)) * 4099 + b"tail"


def feed(algo: str, data: bytes, pieces: int, params=()) -> str:
    h = new_hasher(Checksum(algo, "", params), len(data))
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        h.update(memoryview(data)[i : i + step])
    return h.hexdigest()


@pytest.mark.parametrize("pieces", [1, 7, 1000])
def test_standard_algorithms(pieces):
    assert feed("sha256", DATA, pieces) == hashlib.sha256(DATA).hexdigest()
    assert feed("md5", DATA, pieces) == hashlib.md5(DATA).hexdigest()
    assert feed("crc32", DATA, pieces) == f"{zlib.crc32(DATA):08x}"


def test_crc32c_known_vector():
    # RFC 3720 B.4: 32 bytes of zeros -> 0x8a9136aa
    assert feed("crc32c", bytes(32), 3) == "8a9136aa"


def test_git_blob_sha1_matches_git():
    data = b"hello\n"
    assert feed("git-blob-sha1", data, 1) == "ce013625030ba8dba906f756967f9e9ca394464a"  # `git hash-object`


@pytest.mark.parametrize("pieces", [1, 13])
def test_s3_multipart_etag(pieces):
    part = 5000
    parts = [DATA[i : i + part] for i in range(0, len(DATA), part)]
    expected = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + f"-{len(parts)}"
    assert feed("s3-etag", DATA, pieces, (("part_size", str(part)),)) == expected


def test_multihasher_reports_mismatches_and_local_digest(tmp_path):
    good = Checksum("sha256", hashlib.sha256(DATA).hexdigest())
    bad = Checksum("md5", "0" * 32)
    unknown = Checksum("blake9", "00")
    mh = MultiHasher([good, bad, unknown], len(DATA))
    mh.update(DATA)
    assert mh.mismatches() == [(bad, hashlib.md5(DATA).hexdigest())]
    p = tmp_path / "f"
    p.write_bytes(DATA)
    assert hash_file(p).local_hexdigest() == mh.local_hexdigest()


def test_b64_to_hex():
    assert b64_to_hex("1B2M2Y8AsgTpgAmY7PhCfg==") == "d41d8cd98f00b204e9800998ecf8427e"
