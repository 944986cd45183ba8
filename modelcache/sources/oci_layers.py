"""Safe, streaming extraction of OCI image layers (tar, tar+gzip, tar+zstd) into a model folder.

A KServe "modelcar" image keeps the model under ``/models`` of the image's file system; its
layers are tar streams applied in order, with overlay whiteouts (``.wh.<name>`` deletes a name
of a lower layer, ``.wh..wh..opq`` empties a directory of lower-layer content). We keep only
the selected subtree and refuse anything that could write or point outside the model folder:
``..`` in a name, links whose target leaves the folder, entries written through a symlink,
devices and FIFOs. Each layer's sha256 is checked over the compressed bytes as they stream.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import posixpath
import shutil
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

from modelcache.errors import IntegrityError, SourceError, UnsupportedError
from modelcache.sources.compression import CorruptStreamError, verified_tar

_COPY_CHUNK = 1 << 20
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"

#: Layer media types we can unpack, by compression. "+zstd" needs the zstandard package.
TAR_MEDIA_TYPES: dict[str, str] = {
    "application/vnd.oci.image.layer.v1.tar": "",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": "",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
    # What oras gives a pushed directory (and its own default for layers).
    "application/x-tar": "",
    "application/tar+gzip": "gzip",
}


def corrupt_stream_errors() -> tuple[type[BaseException], ...]:
    """What decompressors and tar raise on bytes that are not a valid layer."""
    errors: tuple[type[BaseException], ...] = (
        tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, CorruptStreamError)
    try:
        import zstandard
    except ModuleNotFoundError:
        return errors
    return (*errors, zstandard.ZstdError)


class UnsafeArchiveError(SourceError):
    """A layer entry would escape the model folder; the whole pull is refused."""

    reason = "UnsafeArchive"


class DigestReader(io.RawIOBase):
    """Passes a blob through while hashing it and reporting progress; ``finish`` checks it."""

    def __init__(self, raw: IO[bytes], on_bytes: Callable[[int], None]) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self._on_bytes = on_bytes
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        data = self._raw.read(len(buf))
        n = len(data)
        if n:
            buf[:n] = data
            self._hash.update(data)
            self.count += n
            self._on_bytes(n)
        return n

    def finish(self, digest: str, size: int | None, where: str) -> None:
        """Read what the tar reader left (end-of-archive padding) and compare the digest."""
        while self.read(_COPY_CHUNK):
            pass
        algo, _, want = digest.partition(":")
        if algo != "sha256":
            raise UnsupportedError(f"{where}: layer digest algorithm '{algo}' is not supported")
        got = self._hash.hexdigest()
        if got != want or (size is not None and self.count != size):
            raise IntegrityError(
                f"{where}: layer {digest} failed verification (got sha256:{got}, {self.count} bytes); "
                "the registry returned corrupted data"
            )


@contextlib.contextmanager
def open_layer_tar(stream: IO[bytes], media_type: str, where: str) -> Iterator[tarfile.TarFile]:
    """A streaming tar reader over a layer blob. The decompressor is chosen by magic bytes (a
    mislabelled plain/gzip layer still opens) and read to its end on exit, so the gzip CRC or
    zstd checksum of the layer is checked as well as its digest."""
    compression = TAR_MEDIA_TYPES.get(media_type)
    if compression is None:
        raise UnsupportedError(f"{where}: layer media type '{media_type}' is not a tar layer; cannot unpack it")
    if compression == "zstd":
        try:
            import zstandard  # noqa: F401
        except ModuleNotFoundError as exc:
            raise UnsupportedError(
                f"{where}: zstd-compressed layers are not supported (install 'zstandard'); "
                "rebuild the image with gzip layers"
            ) from exc
    with verified_tar(stream) as tar:
        yield tar


@dataclass
class LayerExtractor:
    """Applies tar layers, in order, to ``root``; ``prefix`` selects the archive subtree kept."""

    root: str
    where: str
    #: Keep entries under this top-level folder (stripped), e.g. "models"; None keeps all.
    prefix: str | None = "models"
    seen: bool = False

    def apply(self, tar: tarfile.TarFile, layer: str) -> None:
        written: set[str] = set()
        for member in tar:
            rel = self._select(member.name, layer)
            if rel is None:
                continue
            self.seen = True
            if rel == "":
                if not member.isdir():
                    raise UnsafeArchiveError(f"{self.where}: layer {layer}: '{member.name}' is not a directory")
                continue
            parent, base = posixpath.split(rel)
            if base == OPAQUE:
                self._make_opaque(parent, written)
            elif base.startswith(WHITEOUT):
                self._remove(posixpath.join(parent, base[len(WHITEOUT) :]))
            else:
                self._write(tar, member, rel, layer)
                written.add(rel)

    def files(self) -> list[str]:
        """Relative paths of the regular files (and symlinks to them) now in ``root``, after a
        final physical check that no symlink (alone or through a chain) resolves outside it."""
        out: list[str] = []
        real_root = os.path.realpath(self.root)
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                if os.path.islink(full):
                    real = os.path.realpath(full)
                    if real != real_root and not real.startswith(real_root + os.sep):
                        raise UnsafeArchiveError(f"{self.where}: symlink '{rel}' resolves outside the model folder")
                    if not os.path.isfile(real):
                        continue  # links to folders or dangling stay as they are, but are not files
                out.append(rel)
        return sorted(out)

    # -- entry handling -------------------------------------------------------------------

    def _select(self, name: str, layer: str) -> str | None:
        """Map an archive name to a path relative to the model root, None if not kept."""
        # A leading "/" is stripped, as tarfile's "data" filter (KServe's) does; ".." never passes.
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts or "\x00" in name:
            raise UnsafeArchiveError(f"{self.where}: layer {layer}: entry '{name}' escapes the model folder; refused")
        if self.prefix is None:
            return "/".join(parts) if parts else None
        if not parts or parts[0] != self.prefix:
            return None
        return "/".join(parts[1:])

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/"))

    def _ensure_parent(self, rel: str, layer: str) -> None:
        """Create the parent folders as real directories; never write through a symlink."""
        current = self.root
        for part in rel.split("/")[:-1]:
            current = os.path.join(current, part)
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                os.mkdir(current, 0o755)
                continue
            if stat.S_ISDIR(st.st_mode):
                continue
            if stat.S_ISLNK(st.st_mode):
                raise UnsafeArchiveError(
                    f"{self.where}: layer {layer}: '{rel}' would be written through a symlink; refused"
                )
            os.unlink(current)  # a lower layer's file replaced by a folder
            os.mkdir(current, 0o755)

    def _clear(self, path: str, keep_dir: bool) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            if not keep_dir:
                shutil.rmtree(path)
        else:
            os.unlink(path)

    def _write(self, tar: tarfile.TarFile, member: tarfile.TarInfo, rel: str, layer: str) -> None:
        self._ensure_parent(rel, layer)
        dest = self._path(rel)
        self._clear(dest, keep_dir=member.isdir())
        if member.isdir():
            os.makedirs(dest, 0o755, exist_ok=True)
        elif member.isreg():
            src = tar.extractfile(member)
            assert src is not None
            mode = 0o755 if member.mode & 0o111 else 0o644
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out, _COPY_CHUNK)
        elif member.issym():
            target = member.linkname
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
            if target.startswith("/") or resolved == ".." or resolved.startswith("../"):
                raise UnsafeArchiveError(
                    f"{self.where}: layer {layer}: symlink '{rel}' -> '{target}' points outside the model folder; "
                    "refused"
                )
            os.symlink(target, dest)
        elif member.islnk():
            target_rel = self._select(member.linkname, layer)
            if not target_rel:
                raise UnsafeArchiveError(
                    f"{self.where}: layer {layer}: hard link '{rel}' -> '{member.linkname}' points outside the "
                    "model folder; refused"
                )
            src_path = self._path(target_rel)
            if not os.path.isfile(src_path) or os.path.islink(src_path):
                raise UnsafeArchiveError(f"{self.where}: layer {layer}: hard link '{rel}' has no target file; refused")
            shutil.copyfile(src_path, dest, follow_symlinks=False)
        else:
            raise UnsafeArchiveError(
                f"{self.where}: layer {layer}: '{member.name}' is a device, FIFO or other special file; refused"
            )

    def _remove(self, rel: str) -> None:
        if rel:
            self._clear(self._path(rel), keep_dir=False)

    def _make_opaque(self, parent: str, written: set[str]) -> None:
        """Drop what lower layers put in ``parent`` (this layer's own entries stay)."""
        folder = self._path(parent) if parent else self.root
        if not os.path.isdir(folder) or os.path.islink(folder):
            return
        for child in os.listdir(folder):
            crel = posixpath.join(parent, child) if parent else child
            if crel in written or any(w.startswith(crel + "/") for w in written):
                continue
            self._clear(os.path.join(folder, child), keep_dir=False)
