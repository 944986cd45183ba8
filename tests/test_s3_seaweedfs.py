"""The S3 source against a production S3 server (SeaweedFS, tests/fixtures/seaweedfs.py), for what
moto cannot make honest: it ignores ``PartNumber`` on GET, reads the whole object for every
ranged GET, and its checksums are computed by the same SDK code that checks them. Here the
server keeps multipart ETags and composite CRCs of its own, splits objects into 4 MiB chunks on
its volumes (ranges cross them), and answers ``If-Match`` with 412. The whole object-store pull
suite (test_objectstore_pull.py) runs against it too."""

from __future__ import annotations

import hashlib
import math
import os

import pytest
from boto3.s3.transfer import TransferConfig

from modelcache.errors import SourceError
from modelcache.sources.base import open_source
from modelcache.sources.integrity import new_hasher
from tests.fixtures.s3 import S3Server
from tests.objectstore_data import crc32_hex, md5_hex, read_range, settings

MiB = 1 << 20


def _multipart_etag(data: bytes, part: int) -> str:
    parts = [data[i : i + part] for i in range(0, len(data), part)]
    return hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + f"-{len(parts)}"


@pytest.mark.parametrize("part", [5 * MiB, 6 * MiB + 512])
def test_multipart_etag_part_size_from_the_server(seaweedfs_s3: S3Server, tmp_path, part: int) -> None:
    """The part size comes from the server's HeadObject(PartNumber=1) (moto's answer is the SDK's
    own bookkeeping); the ETag check then recomputes the server's multipart ETag, and the
    server's per-part (COMPOSITE) CRC is not mistaken for a whole-object one."""
    bucket = seaweedfs_s3.new_bucket()
    c = seaweedfs_s3.client()
    data = os.urandom(2 * part + 777_777)
    (tmp_path / "mp.bin").write_bytes(data)
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part)
    c.upload_file(str(tmp_path / "mp.bin"), bucket, "m/w.bin", Config=cfg)
    head = c.head_object(Bucket=bucket, Key="m/w.bin", ChecksumMode="ENABLED")
    assert head["ETag"].strip('"') == _multipart_etag(data, part)
    assert head.get("ChecksumType") in (None, "COMPOSITE"), head  # never FULL_OBJECT for this upload
    with open_source(f"s3://{bucket}/m", settings(seaweedfs_s3.env())) as src:
        (f,) = src.list_files()
        algos = {ck.algo: ck for ck in f.checksums}
        assert set(algos) == {"s3-etag"}, f.checksums
        etag = algos["s3-etag"]
        assert etag.param("part_size") == str(part) and etag.param("parts") == str(math.ceil(len(data) / part))
        got = read_range(src, f)
    assert got == data
    h = new_hasher(etag, len(data))
    h.update(got)
    assert h.hexdigest() == etag.value


def test_single_put_full_object_crc_and_md5_etag(seaweedfs_s3: S3Server) -> None:
    bucket = seaweedfs_s3.new_bucket()
    c = seaweedfs_s3.client()
    data = os.urandom(9 * MiB + 3)  # three of the server's 4 MiB chunks
    c.put_object(Bucket=bucket, Key="m/crc.bin", Body=data)  # boto3 >= 1.36 sends a CRC32 the server keeps
    plain = seaweedfs_s3.client()
    plain.meta.config.request_checksum_calculation = "when_required"
    plain.put_object(Bucket=bucket, Key="m/md5.bin", Body=data)
    with open_source(f"s3://{bucket}/m", settings(seaweedfs_s3.env())) as src:
        files = {f.path: f for f in src.list_files()}
    assert [(ck.algo, ck.value) for ck in files["crc.bin"].checksums] == [("crc32", crc32_hex(data))]
    assert [(ck.algo, ck.value) for ck in files["md5.bin"].checksums] == [("md5", md5_hex(data))]


def test_ranges_across_the_servers_chunks(seaweedfs_s3: S3Server) -> None:
    """Ranged GETs starting and ending on both sides of SeaweedFS's 4 MiB chunk boundaries and
    of multipart part boundaries come back exact (206 and Content-Range checked by the source)."""
    bucket = seaweedfs_s3.new_bucket()
    c = seaweedfs_s3.client()
    data = os.urandom(13 * MiB + 5)
    c.put_object(Bucket=bucket, Key="m/w.bin", Body=data)
    with open_source(f"s3://{bucket}/m", settings(seaweedfs_s3.env())) as src:
        (f,) = src.list_files()
        for start, end in [(0, 1), (4 * MiB - 1, 4 * MiB + 1), (4 * MiB, 8 * MiB), (3 * MiB, 9 * MiB + 17),
                           (12 * MiB + 1, None), (len(data) - 1, None)]:
            assert read_range(src, f, start, end) == data[start:end], (start, end)


def test_overwrite_after_listing_gets_412(seaweedfs_s3: S3Server) -> None:
    """Reads carry If-Match with the listed ETag; the real server refuses them after an overwrite."""
    bucket = seaweedfs_s3.new_bucket()
    c = seaweedfs_s3.client()
    c.put_object(Bucket=bucket, Key="m/w.bin", Body=b"version one" * 1000)
    with open_source(f"s3://{bucket}/m", settings(seaweedfs_s3.env())) as src:
        (f,) = src.list_files()
        assert read_range(src, f, 0, 11) == b"version one"
        c.put_object(Bucket=bucket, Key="m/w.bin", Body=b"version two" * 1000)
        with pytest.raises(SourceError) as err:
            read_range(src, f, 11, 22)
    msg = str(err.value)
    assert "changed while it was being downloaded" in msg and f"s3://{bucket}/m" in msg and "\n" not in msg
