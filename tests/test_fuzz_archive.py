"""Property-based tests of archive unpacking: mutated tar, tar.gz, tar.xz, tar.zst and zip inputs.

Whatever the damage, an unpack ends in one of two ways: a clean refusal (an ``ArchiveError``,
DEST exactly as before), or success. Never another exception, never a file outside DEST, and
never wrong bytes from a format that checks its data: the compressed tars (gzip CRC-32 and
ISIZE, xz CRC64, zstd content checksum) reproduce the original tree exactly, and every regular
file a zip yields has its entry's bytes (CRC-32 per entry; a zip's file modes are not covered by
any check, so a damaged mode may turn a file into a link, which must still resolve inside).
A plain tar has no data checksum: only the safety half holds for it.
"""

from __future__ import annotations

import gzip
import io
import lzma
import os
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest
import zstandard
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from modelcache.sources.archive import ArchiveError, ArchiveLimits, unpack_archive
from tests.fuzzing import examples, mutate, mutation

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(600)]

NAMES = ["w.bin", "config.json", "m/a.bin", "m/b.txt", "m/n/c.bin", "tok.model"]
LIMITS = ArchiveLimits(max_bytes=1 << 20, max_entries=64)

tree = st.dictionaries(
    st.sampled_from(NAMES),
    st.one_of(st.binary(max_size=3000), st.integers(0, 3000).map(os.urandom), st.sampled_from([b"", b"a" * 2000])),
    min_size=1, max_size=4,
).filter(lambda t: not ({"m/a.bin", "m/b.txt", "m/n/c.bin"} & set(t) and "m" in t))


def _tight_tar(files: dict[str, bytes]) -> bytes:
    """A tar without the zero padding to a 10 KiB record after its end blocks (still valid): the
    damage then lands in headers and data, not mostly in padding nobody reads."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    end = tf.offset  # just past the two end-of-archive blocks
    return raw.getvalue()[:end]


def build(kind: str, files: dict[str, bytes], level: int) -> bytes:
    if kind == "zip":
        raw = io.BytesIO()
        method = zipfile.ZIP_STORED if level == 0 else zipfile.ZIP_DEFLATED
        with zipfile.ZipFile(raw, "w", compression=method) as zf:
            for name, data in files.items():
                zf.writestr(name, data)
        return raw.getvalue()
    tar = _tight_tar(files)
    if kind == "tar.gz":
        return gzip.compress(tar, compresslevel=level)
    if kind == "tar.xz":
        return lzma.compress(tar, check=lzma.CHECK_CRC64)
    if kind == "tar.zst":
        return zstandard.ZstdCompressor(level=max(1, level), write_checksum=True).compress(tar)
    return tar


def snapshot(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            out[rel] = f"link:{os.readlink(p)}" if p.is_symlink() else ("dir" if p.is_dir() else p.read_bytes())
    return out


def check_unpack(kind: str, files: dict[str, bytes], blob: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        box = Path(tmp)
        dest, outside = box / "dest", box / "outside"
        dest.mkdir()
        outside.mkdir()
        (outside / "secret").write_bytes(b"keep")
        archive = dest / f"model.{kind}"
        archive.write_bytes(blob)
        before = snapshot(dest)
        try:
            unpack_archive(archive, dest, LIMITS)
        except ArchiveError as exc:
            assert "\n" not in str(exc)
            assert snapshot(dest) == before, "a refused archive changed DEST"
            ok = False
        else:
            ok = True
        assert sorted(p.name for p in box.iterdir()) == ["dest", "outside"], "something was written beside DEST"
        assert snapshot(outside) == {"secret": b"keep"}
        if not ok:
            return
        real_dest = os.path.realpath(dest)
        got = snapshot(dest)
        for rel, value in got.items():
            assert os.path.realpath(dest / rel).startswith(real_dest + os.sep), f"{rel} resolves outside DEST"
            if isinstance(value, bytes) and not (dest / rel).is_symlink() and kind != "tar":
                assert value == files.get(rel), f"{kind}: {rel} unpacked with wrong bytes"
        if kind in ("tar.gz", "tar.xz", "tar.zst"):
            assert {k: v for k, v in got.items() if isinstance(v, bytes)} == files


@hsettings(max_examples=examples(150))
@given(st.sampled_from(["tar", "tar.gz", "tar.xz", "tar.zst", "zip"]), tree, st.sampled_from([0, 6]),
       st.lists(mutation, min_size=1, max_size=3))
def test_a_damaged_archive_is_refused_or_unpacked_right(kind: str, files: dict[str, bytes], level: int,
                                                        ops: list[tuple]) -> None:
    check_unpack(kind, files, mutate(build(kind, files, level), ops))


@hsettings(max_examples=examples(40))
@given(st.sampled_from(["tar", "tar.gz", "tar.xz", "tar.zst", "zip"]), tree, st.sampled_from([0, 6]))
def test_an_intact_archive_unpacks_exactly(kind: str, files: dict[str, bytes], level: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp)
        (dest / f"m.{kind}").write_bytes(build(kind, files, level))
        unpack_archive(dest / f"m.{kind}", dest, LIMITS)
        assert {k: v for k, v in snapshot(dest).items() if isinstance(v, bytes)} == files


@hsettings(max_examples=examples(150))
@given(st.sampled_from(["tar", "tar.gz", "zip"]), st.binary(max_size=2000))
def test_any_bytes_as_an_archive_end_cleanly(kind: str, blob: bytes) -> None:
    check_unpack(kind, {}, blob)
