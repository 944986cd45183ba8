"""Safe archive unpacking: crafted good and hostile archives, unpacked for real on disk."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from modelcache.errors import ModelcacheError
from modelcache.sources.archive import (
    INVALID_FORMAT,
    ArchiveError,
    ArchiveLimitError,
    ArchiveLimits,
    UnsafeArchiveError,
    archive_kind,
    remove_stale_staging,
    unpack_archive,
)
from tests.archive_util import flip_in_payload, make_tar, make_zip, tar_bytes, tar_entry, tar_file, zip_special


def _tree(root: Path) -> dict[str, str]:
    """Relative path -> 'dir' | 'link:<target>' | file content (text)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = f"link:{os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes().decode("latin-1")
    return out


@pytest.fixture()
def box(tmp_path: Path) -> Path:
    """A folder holding dest/ and a sentinel sibling that hostile archives aim at."""
    (tmp_path / "dest").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("keep me")
    return tmp_path


def _assert_untouched(box: Path, before_dest: dict[str, str]) -> None:
    assert sorted(p.name for p in box.iterdir()) == ["dest", "outside"]
    assert _tree(box / "outside") == {"secret": "keep me"}
    assert _tree(box / "dest") == before_dest


# -- good archives ----------------------------------------------------------------------------


GOOD_TAR_ENTRIES = [
    tar_entry("./", tarfile.DIRTYPE),
    tar_entry("./model", tarfile.DIRTYPE),
    tar_file("./model/config.json", b'{"a": 1}'),
    tar_file("./model/run.sh", b"#!/bin/sh\n", 0o755),
    tar_file("model/weights/part-0.bin", b"\x00\x01" * 5000),
    tar_entry("model/latest", tarfile.SYMTYPE, "weights/part-0.bin"),
    tar_entry("model/weights/again.bin", tarfile.LNKTYPE, "model/weights/part-0.bin"),
    tar_entry("model/up", tarfile.SYMTYPE, "../model/config.json"),
]


@pytest.mark.parametrize("name,mode", [("m.tar", "w"), ("m.tar.gz", "w:gz"), ("m.tgz", "w:gz"), ("m.tar.xz", "w:xz")])
def test_good_tar_unpacks_and_is_removed(box: Path, name: str, mode: str) -> None:
    dest = box / "dest"
    archive = make_tar(dest / name, GOOD_TAR_ENTRIES, mode)
    res = unpack_archive(archive, dest)
    assert not archive.exists()
    tree = _tree(dest)
    assert tree["model/config.json"] == '{"a": 1}'
    assert tree["model/latest"] == "link:weights/part-0.bin"
    assert (dest / "model/latest").read_bytes() == b"\x00\x01" * 5000
    assert (dest / "model/up").read_text() == '{"a": 1}'
    assert os.stat(dest / "model/weights/again.bin").st_ino == os.stat(dest / "model/weights/part-0.bin").st_ino
    assert os.stat(dest / "model/run.sh").st_mode & 0o111
    assert not os.stat(dest / "model/config.json").st_mode & 0o111
    assert res.files == 4 and res.symlinks == 2 and res.bytes == 8 + 10 + 10000
    assert sorted(p.name for p in dest.iterdir()) == ["model"]  # no staging left


def test_good_zip_with_dirs_and_symlink(box: Path) -> None:
    dest = box / "dest"
    link = zip_special("m/current", stat.S_IFLNK | 0o777)
    with zipfile.ZipFile(dest / "m.zip", "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("m/", b"")
        zf.writestr("m/a.txt", b"hello")
        zf.writestr("m/sub/b.bin", os.urandom(3000))
        zf.writestr(link, b"a.txt")
    res = unpack_archive(dest / "m.zip", dest)
    assert not (dest / "m.zip").exists()
    assert (dest / "m/a.txt").read_text() == "hello"
    assert os.readlink(dest / "m/current") == "a.txt"
    assert (dest / "m/sub/b.bin").stat().st_size == 3000
    assert res.files == 2 and res.symlinks == 1


def test_merge_keeps_other_files_overwrites_same_and_replaces_links(box: Path) -> None:
    dest = box / "dest"
    (dest / "keep.txt").write_text("mine")
    (dest / "model").mkdir()
    (dest / "model" / "config.json").write_text("old")
    (dest / "model" / "extra").write_text("extra")
    # A pre-existing link pointing outside must be replaced, not written through.
    (dest / "weights").symlink_to(box / "outside")
    make_tar(dest / "m.tar", [tar_file("model/config.json", b"new"), tar_file("weights/w.bin", b"w")])
    unpack_archive(dest / "m.tar", dest)
    assert (dest / "keep.txt").read_text() == "mine"
    assert (dest / "model/config.json").read_text() == "new"
    assert (dest / "model/extra").read_text() == "extra"
    assert not (dest / "weights").is_symlink() and (dest / "weights/w.bin").read_text() == "w"
    assert _tree(box / "outside") == {"secret": "keep me"}


def test_duplicate_tar_entry_later_wins(box: Path) -> None:
    dest = box / "dest"
    make_tar(dest / "m.tar", [tar_file("a.txt", b"first"), tar_file("a.txt", b"second")])
    unpack_archive(dest / "m.tar", dest)
    assert (dest / "a.txt").read_text() == "second"


def test_archive_kind() -> None:
    assert archive_kind("x.TAR.GZ") == "tar" and archive_kind("x.tgz") == "tar" and archive_kind("x.tar") == "tar"
    assert archive_kind("x.zip") == "zip"
    assert archive_kind("model.bin") is None and archive_kind("x.gz") is None


# -- hostile archives: refused, and nothing written anywhere -----------------------------------


HOSTILE_TARS = {
    "tar-slip": [tar_file("ok.txt", b"ok"), tar_file("../evil.txt", b"x")],
    "tar-slip-nested": [tar_file("a/b/../../../evil.txt", b"x")],
    "absolute": [tar_file("/tmp/evil-modelcache.txt", b"x")],
    "symlink-escape": [tar_entry("link", tarfile.SYMTYPE, "../outside")],
    "symlink-absolute": [tar_entry("link", tarfile.SYMTYPE, "/etc/passwd")],
    # Each link is inside on its own; together 'a' resolves to the parent of dest.
    "symlink-chain": [tar_entry("a", tarfile.SYMTYPE, "b/.."), tar_entry("b", tarfile.SYMTYPE, ".")],
    "symlink-then-write-through": [tar_entry("d", tarfile.SYMTYPE, "sub"), tar_file("d/x.txt", b"x")],
    "hardlink-escape": [tar_entry("h", tarfile.LNKTYPE, "../outside/secret")],
    "hardlink-absolute": [tar_entry("h", tarfile.LNKTYPE, "/etc/passwd")],
    "hardlink-not-member": [tar_entry("h", tarfile.LNKTYPE, "nothere")],
    "hardlink-to-symlink": [tar_entry("s", tarfile.SYMTYPE, "x"), tar_entry("h", tarfile.LNKTYPE, "s")],
    "char-device": [tar_entry("dev", tarfile.CHRTYPE)],
    "block-device": [tar_entry("dev", tarfile.BLKTYPE)],
    "fifo": [tar_entry("pipe", tarfile.FIFOTYPE)],
    "reserved-name": [tar_file(".modelcache/manifest.json", b"{}")],
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TARS))
def test_hostile_tar_is_refused_and_dest_untouched(box: Path, case: str) -> None:
    dest = box / "dest"
    (dest / "existing.txt").write_text("before")
    archive = make_tar(dest / "bad.tar.gz", HOSTILE_TARS[case], "w:gz")
    before = _tree(dest)
    with pytest.raises(UnsafeArchiveError) as err:
        unpack_archive(archive, dest, reserved=(".modelcache",))
    assert "bad.tar.gz" in str(err.value) and "\n" not in str(err.value)
    _assert_untouched(box, before)
    assert not Path("/tmp/evil-modelcache.txt").exists()


HOSTILE_ZIPS = {
    "zip-slip": [("ok.txt", b"ok"), ("../../evil.txt", b"x")],
    "zip-slip-backslash": [("..\\evil.txt", b"x")],
    "absolute": [("/tmp/evil-modelcache.txt", b"x")],
    "drive": [("C:/evil.txt", b"x")],
    "symlink-escape": [(zip_special("link", stat.S_IFLNK | 0o777), b"../../outside")],
    "fifo": [zip_special("pipe", stat.S_IFIFO | 0o644)],
    "device": [zip_special("dev", stat.S_IFCHR | 0o644)],
}


@pytest.mark.parametrize("case", sorted(HOSTILE_ZIPS))
def test_hostile_zip_is_refused_and_dest_untouched(box: Path, case: str) -> None:
    dest = box / "dest"
    archive = make_zip(dest / "bad.zip", HOSTILE_ZIPS[case])  # type: ignore[arg-type]
    before = _tree(dest)
    with pytest.raises(UnsafeArchiveError) as err:
        unpack_archive(archive, dest)
    assert "bad.zip" in str(err.value)
    _assert_untouched(box, before)
    assert not Path("/tmp/evil-modelcache.txt").exists()


# -- bombs --------------------------------------------------------------------------------------


def test_bomb_over_ratio_cap_with_default_limits(box: Path) -> None:
    dest = box / "dest"
    # 8 MiB of zeros gzip to ~8 KiB: a ratio near 1000, refused by the default cap of 200.
    make_tar(dest / "bomb.tar.gz", [tar_file("zeros.bin", bytes(8 << 20))], "w:gz")
    before = _tree(dest)
    with pytest.raises(ArchiveLimitError, match="compression ratio"):
        unpack_archive(dest / "bomb.tar.gz", dest)
    _assert_untouched(box, before)


def test_zip_bomb_over_ratio_cap(box: Path) -> None:
    dest = box / "dest"
    make_zip(dest / "bomb.zip", [("zeros.bin", bytes(8 << 20))])
    before = _tree(dest)
    with pytest.raises(ArchiveLimitError, match="compression ratio"):
        unpack_archive(dest / "bomb.zip", dest)
    _assert_untouched(box, before)


def test_bomb_over_byte_cap_stops_while_streaming(box: Path) -> None:
    dest = box / "dest"
    # The header is honest but the cap is low: refused mid-stream, nothing left behind.
    make_tar(dest / "big.tar", [tar_file("a.bin", os.urandom(600_000)), tar_file("b.bin", os.urandom(600_000))])
    before = _tree(dest)
    with pytest.raises(ArchiveLimitError, match="MODELCACHE_ARCHIVE_MAX_BYTES"):
        unpack_archive(dest / "big.tar", dest, ArchiveLimits(max_bytes=1_000_000))
    _assert_untouched(box, before)


def test_zip_over_byte_cap_refused_before_writing(box: Path) -> None:
    dest = box / "dest"
    make_zip(dest / "big.zip", [("a.bin", os.urandom(300_000)), ("b.bin", os.urandom(300_000))])
    before = _tree(dest)
    with pytest.raises(ArchiveLimitError):
        unpack_archive(dest / "big.zip", dest, ArchiveLimits(max_bytes=500_000))
    _assert_untouched(box, before)


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_bomb_over_entry_cap(box: Path, kind: str) -> None:
    dest = box / "dest"
    files = [(f"f{i}.txt", b"x") for i in range(30)]
    if kind == "tar":
        archive = make_tar(dest / "many.tar", [tar_file(n, d) for n, d in files])
    else:
        archive = make_zip(dest / "many.zip", files)  # type: ignore[arg-type]
    before = _tree(dest)
    with pytest.raises(ArchiveLimitError, match="more than 20 entries"):
        unpack_archive(archive, dest, ArchiveLimits(max_entries=20))
    _assert_untouched(box, before)


def test_small_compressible_archive_is_not_a_bomb(box: Path) -> None:
    dest = box / "dest"
    # 512 KiB of text compresses >200x but stays under ratio_min_bytes: unpacked.
    make_tar(dest / "cfg.tar.gz", [tar_file("vocab.txt", b"a" * (512 << 10))], "w:gz")
    unpack_archive(dest / "cfg.tar.gz", dest)
    assert (dest / "vocab.txt").stat().st_size == 512 << 10


def test_limits_from_env() -> None:
    env = {
        "MODELCACHE_ARCHIVE_MAX_BYTES": "1000",
        "MODELCACHE_ARCHIVE_MAX_ENTRIES": "7",
        "MODELCACHE_ARCHIVE_MAX_RATIO": "2.5",
    }
    limits = ArchiveLimits.from_env(env)
    assert (limits.max_bytes, limits.max_entries, limits.max_ratio) == (1000, 7, 2.5)
    assert ArchiveLimits.from_env({}) == ArchiveLimits()
    assert ArchiveLimits().max_bytes == 2 << 40 and ArchiveLimits().max_entries == 1_000_000
    with pytest.raises(ModelcacheError, match="MODELCACHE_ARCHIVE_MAX_ENTRIES"):
        ArchiveLimits.from_env({"MODELCACHE_ARCHIVE_MAX_ENTRIES": "lots"})
    with pytest.raises(ModelcacheError, match="positive"):
        ArchiveLimits.from_env({"MODELCACHE_ARCHIVE_MAX_BYTES": "0"})


# -- corrupt archives ---------------------------------------------------------------------------


def _truncated_targz(path: Path) -> Path:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tf:
        info, data = tar_file("w.bin", os.urandom(200_000))
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    path.write_bytes(raw.getvalue()[: len(raw.getvalue()) // 2])
    return path


def _bad_crc_zip(path: Path) -> Path:
    make_zip(path, [("w.bin", b"hello world" * 100)])
    data = bytearray(path.read_bytes())
    # Flip a byte inside the deflate stream of the only member (after its local header).
    data[40] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


CORRUPT = {
    "truncated.tar.gz": _truncated_targz,
    "garbage.zip": lambda p: (p.write_bytes(os.urandom(5000)), p)[1],
    "garbage.tar": lambda p: (p.write_bytes(b"not a tar" * 200), p)[1],
    "garbage.tgz": lambda p: (p.write_bytes(gzip.compress(b"not a tar" * 200)), p)[1],
    "badcrc.zip": _bad_crc_zip,
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_corrupt_archive_gives_kserve_message(box: Path, name: str) -> None:
    dest = box / "dest"
    archive = CORRUPT[name](dest / name)
    before = _tree(dest)
    with pytest.raises(ArchiveError) as err:
        unpack_archive(archive, dest)
    msg = str(err.value)
    assert msg.startswith(INVALID_FORMAT) and name in msg and "\n" not in msg
    assert not isinstance(err.value, UnsafeArchiveError | ArchiveLimitError)
    _assert_untouched(box, before)


def test_remove_stale_staging(box: Path) -> None:
    dest = box / "dest"
    (dest / ".modelcache-unpack-abc").mkdir()
    (dest / ".modelcache-unpack-abc" / "half.bin").write_bytes(b"x")
    (dest / "model.bin").write_bytes(b"m")
    remove_stale_staging(dest)
    assert _tree(dest) == {"model.bin": "m"}


def test_entry_named_like_the_archive_survives(box: Path) -> None:
    dest = box / "dest"
    make_tar(dest / "m.tar", [tar_file("m.tar", b"inner"), tar_file("x.txt", b"x")])
    unpack_archive(dest / "m.tar", dest)
    assert (dest / "m.tar").read_bytes() == b"inner" and (dest / "x.txt").read_bytes() == b"x"


def test_archive_through_symlink_removes_link_only(box: Path) -> None:
    dest = box / "dest"
    src = make_tar(box / "outside" / "m.tar", [tar_file("x.txt", b"x")])
    (dest / "m.tar").symlink_to(src)
    unpack_archive(dest / "m.tar", dest)
    assert not os.path.lexists(dest / "m.tar") and src.exists()
    assert (dest / "x.txt").read_bytes() == b"x"


def test_on_bytes_reports_every_unpacked_byte(box: Path) -> None:
    dest = box / "dest"
    make_tar(dest / "m.tar", [tar_file("a.bin", os.urandom(3 << 20)), tar_file("b.bin", b"xyz")])
    seen: list[int] = []
    res = unpack_archive(dest / "m.tar", dest, on_bytes=seen.append)
    assert sum(seen) == res.bytes == (3 << 20) + 3 and len(seen) >= 3


# -- damage only the format's own check can see ---------------------------------------------------
#
# The payload is random and stored without real compression (gzip level 0, xz/zstd of random
# data), so a flipped byte leaves a well-formed stream that decompresses to wrong bytes: only the
# gzip CRC-32, the xz CRC64 or the zstd content checksum tells, and only at the end of the stream.


def _compress(kind: str, data: bytes) -> bytes:
    import lzma

    import zstandard

    if kind == "tar.gz":
        return gzip.compress(data, compresslevel=0)
    if kind == "tar.xz":
        return lzma.compress(data, check=lzma.CHECK_CRC64)
    return zstandard.ZstdCompressor(write_checksum=True).compress(data)


@pytest.mark.parametrize("kind", ["tar.gz", "tar.xz", "tar.zst"])
def test_damage_only_the_stream_check_sees_is_refused(box: Path, kind: str) -> None:
    dest = box / "dest"
    payload = os.urandom(300_000)
    blob = _compress(kind, tar_bytes({"w.bin": payload, "config.json": b"{}"}))
    (dest / f"m.{kind}").write_bytes(flip_in_payload(blob, payload))
    before = _tree(dest)
    with pytest.raises(ArchiveError) as err:
        unpack_archive(dest / f"m.{kind}", dest)
    msg = str(err.value)
    assert msg.startswith(INVALID_FORMAT) and "corrupt" in msg and "\n" not in msg, msg
    _assert_untouched(box, before)


def test_good_tar_zst_unpacks(box: Path) -> None:
    dest = box / "dest"
    payload = os.urandom(100_000)
    (dest / "m.tar.zst").write_bytes(_compress("tar.zst", tar_bytes({"w.bin": payload})))
    unpack_archive(dest / "m.tar.zst", dest)
    assert (dest / "w.bin").read_bytes() == payload


def test_gzip_trailer_length_mismatch_is_refused(box: Path) -> None:
    dest = box / "dest"
    blob = bytearray(gzip.compress(tar_bytes({"w.bin": os.urandom(50_000)}), compresslevel=0))
    blob[-1] ^= 0x01  # ISIZE, the uncompressed length mod 2^32
    (dest / "m.tgz").write_bytes(bytes(blob))
    with pytest.raises(ArchiveError, match="corrupt"):
        unpack_archive(dest / "m.tgz", dest)
    assert _tree(dest) == {"m.tgz": bytes(blob).decode("latin-1")}


def test_bomb_hidden_after_the_tar_end_is_capped(box: Path) -> None:
    dest = box / "dest"
    # A valid tar, then 8 MiB of zeros inside the same gzip stream: never written, still capped.
    data = tar_bytes({"a.txt": b"a"}) + bytes(8 << 20)
    (dest / "m.tar.gz").write_bytes(gzip.compress(data))
    with pytest.raises(ArchiveLimitError, match="compression ratio"):
        unpack_archive(dest / "m.tar.gz", dest)


def test_zip_stored_entry_with_a_flipped_byte_fails_its_crc(box: Path) -> None:
    dest = box / "dest"
    payload = os.urandom(20_000)
    with zipfile.ZipFile(dest / "m.zip", "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("ok.txt", b"fine")
        zf.writestr("w.bin", payload)
    (dest / "m.zip").write_bytes(flip_in_payload((dest / "m.zip").read_bytes(), payload))
    before = _tree(dest)
    with pytest.raises(ArchiveError, match="Bad CRC-32"):
        unpack_archive(dest / "m.zip", dest)
    _assert_untouched(box, before)


def test_oci_layer_with_a_bad_gzip_crc_is_refused_even_if_its_digest_matches() -> None:
    """A registry verifies the digest it was given; a layer pushed already damaged has a matching
    digest, and only the gzip CRC tells."""
    import hashlib

    from modelcache.sources.compression import CorruptStreamError
    from modelcache.sources.oci_layers import DigestReader, LayerExtractor, open_layer_tar

    payload = os.urandom(200_000)
    blob = flip_in_payload(gzip.compress(tar_bytes({"models/w.bin": payload}), compresslevel=0), payload)
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        reader = DigestReader(io.BytesIO(blob), lambda _n: None)
        with pytest.raises(CorruptStreamError, match="CRC check failed"), \
                open_layer_tar(reader, "application/vnd.oci.image.layer.v1.tar+gzip", "oci://r/m") as tar:
            LayerExtractor(root, "oci://r/m").apply(tar, digest)


@pytest.mark.parametrize(("offset", "value", "needle"), [
    (6, 0x01, "encrypted"),  # general purpose flag bit 0 in the local header...
    (8, 0x63, "compression method"),  # ...compression method 99 (AES), which zipfile lacks
])
def test_zip_features_zipfile_lacks_are_a_clean_refusal(box: Path, offset: int, value: int, needle: str) -> None:
    """Found by the archive fuzzer: these were a NotImplementedError / RuntimeError traceback."""
    dest = box / "dest"
    make_zip(dest / "m.zip", [("w.bin", b"x" * 100)])
    data = bytearray((dest / "m.zip").read_bytes())
    cd = data.rindex(b"PK\x01\x02")  # the central directory entry: the same field 2 bytes later
    data[offset] = data[cd + offset + 2] = value
    (dest / "m.zip").write_bytes(bytes(data))
    with pytest.raises(ArchiveError) as err:
        unpack_archive(dest / "m.zip", dest)
    assert str(err.value).startswith(INVALID_FORMAT) and needle in str(err.value), str(err.value)
