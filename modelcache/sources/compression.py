"""Decompression that checks the format's own integrity data, to the last byte.

gzip ends every member with a CRC-32 and the length (ISIZE), xz and zstd frames may carry a
checksum, bzip2 checks every block. A decompressor only verifies these when it is read to the
end, and a tar reader stops at the end-of-archive blocks, before the gzip trailer: damage in the
middle of a ``.tar.gz`` then unpacks into wrong files without a word. ``verified_tar`` opens a
tar stream over the right decompressor (chosen by magic bytes, as ``tar -x`` does) and, when the
caller is done with the entries, reads the stream to its end so every check runs before the
caller publishes anything. A failed check is one ``CorruptStreamError``, whatever the format.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import IO, Any

_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bz2"), (b"\x28\xb5\x2f\xfd", "zstd"))
_DRAIN_CHUNK = 1 << 20


class CorruptStreamError(ValueError):
    """The compressed bytes fail their own check (CRC, length, checksum) or are not the format."""


def sniff(head: bytes) -> str:
    """"gzip", "xz", "bz2", "zstd", or "" (not compressed: plain tar)."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    return ""


def _zstd_errors() -> tuple[type[BaseException], ...]:
    try:
        import zstandard
    except ModuleNotFoundError:
        return ()
    return (zstandard.ZstdError,)


class _Checked(io.RawIOBase):
    """A decompressing stream whose format errors all become ``CorruptStreamError``.

    OSErrors with an errno come from the file or socket underneath and pass unchanged (a disk or
    network fault is not a corrupt archive); the decompressors' own OSErrors have none.
    """

    def __init__(self, inner: IO[bytes], kind: str) -> None:
        self._inner = inner
        self.kind = kind
        self._errors: tuple[type[BaseException], ...] = (EOFError, zlib.error, lzma.LZMAError, *_zstd_errors())

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        try:
            data = self._inner.read(len(buf))
        except OSError as exc:
            if exc.errno is not None:
                raise
            raise CorruptStreamError(f"{self.kind} data is corrupt ({exc})") from exc
        except self._errors as exc:
            raise CorruptStreamError(f"{self.kind} data is corrupt ({exc or type(exc).__name__})") from exc
        n = len(data)
        buf[:n] = data
        return n


def open_decompressed(raw: IO[bytes]) -> IO[bytes]:
    """The decompressed bytes of ``raw`` (by its magic bytes), checked as they are read."""
    buffered: Any = raw if hasattr(raw, "peek") else io.BufferedReader(raw)
    kind = sniff(buffered.peek(8)[:8])
    if kind == "":
        return buffered
    inner: IO[bytes]
    if kind == "gzip":
        inner = gzip.GzipFile(fileobj=buffered, mode="rb")  # type: ignore[assignment]  # checks CRC-32 and ISIZE
    elif kind == "xz":
        inner = lzma.LZMAFile(buffered)  # noqa: SIM115 (returned open) -- checks the stream's CRC32/CRC64/SHA-256
    elif kind == "bz2":
        inner = bz2.BZ2File(buffered)  # checks every block's CRC and the stream CRC
    else:
        try:
            import zstandard
        except ModuleNotFoundError as exc:
            raise CorruptStreamError("zstd data needs the 'zstandard' package") from exc
        # Verifies each frame's content checksum when the frame carries one.
        inner = zstandard.ZstdDecompressor().stream_reader(buffered, read_across_frames=True)
    return io.BufferedReader(_Checked(inner, kind), _DRAIN_CHUNK)


def drain(stream: IO[bytes], on_bytes: Callable[[int], None] | None = None) -> None:
    """Read ``stream`` to its end (where gzip's trailer and the last checksums are checked).
    ``on_bytes`` sees every decompressed byte, so a caller can cap a bomb hidden after the tar."""
    while chunk := stream.read(_DRAIN_CHUNK):
        if on_bytes is not None:
            on_bytes(len(chunk))


@contextlib.contextmanager
def verified_tar(raw: IO[bytes], on_trailing: Callable[[int], None] | None = None) -> Iterator[tarfile.TarFile]:
    """A streaming tar reader over ``raw`` (plain, gzip, xz, bzip2 or zstd). On a normal exit
    the rest of the stream is read and checked: an exception there means the entries the
    caller wrote are not to be trusted."""
    stream = open_decompressed(raw)
    with tarfile.open(fileobj=stream, mode="r|") as tf:
        yield tf
    drain(stream, on_trailing)
