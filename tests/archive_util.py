"""Builders for crafted tar and zip archives (good and hostile) used by the archive and initializer tests."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path


def make_tar(path: Path, entries: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]], mode: str = "w") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode, format=tarfile.GNU_FORMAT) as tf:
        for e in entries:
            if isinstance(e, tuple):
                info, data = e
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(e)
    return path


def tar_file(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def tar_entry(name: str, type_: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = type_
    info.linkname = linkname
    if type_ == tarfile.DIRTYPE:
        info.mode = 0o755
    return info


def make_zip(path: Path, entries: list[tuple[str, bytes] | zipfile.ZipInfo | tuple[zipfile.ZipInfo, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for e in entries:
            if isinstance(e, zipfile.ZipInfo):
                zf.writestr(e, b"")
            else:
                zf.writestr(e[0], e[1])
    return path


def zip_special(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.create_system = 3  # unix: external_attr carries st_mode
    info.external_attr = mode << 16
    return info




def tar_bytes(entries: dict[str, bytes]) -> bytes:
    """An uncompressed tar of regular files, in memory."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def flip_in_payload(blob: bytes, payload: bytes) -> bytes:
    """Flip one bit of ``blob`` where it holds ``payload`` verbatim (a stored, uncompressed
    region): the container stays well-formed and only its own checksum can tell."""
    at = blob.index(payload[1000:1064]) + 10
    damaged = bytearray(blob)
    damaged[at] ^= 0x04
    return bytes(damaged)


def crc_damaged_targz(path: Path, payload: bytes) -> Path:
    """A .tar.gz (gzip level 0) whose only damage is one flipped bit inside ``payload``."""
    import gzip

    path.write_bytes(flip_in_payload(gzip.compress(tar_bytes({"w.bin": payload}), compresslevel=0), payload))
    return path
