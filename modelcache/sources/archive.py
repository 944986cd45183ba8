"""Safe, streaming unpacking of a fetched model archive (.tar, .tar.gz/.tgz, .zip) into a folder.

KServe's initializer unpacks a single fetched archive into the destination and deletes it
(``tarfile`` with ``filter="data"``, ``zipfile.extractall``). We keep that contract and make it
safe against hostile or broken archives:

* entries with absolute paths or ``..`` are refused, and so are device files, FIFOs and
  sockets;
* hardlinks must name a regular file already unpacked from the same archive;
* symlinks are created only after every regular file is written (so no write ever goes
  through a link the archive made), and the finished tree is checked with ``realpath``: one
  link resolving outside the destination fails the whole archive;
* caps on unpacked bytes, entry count and compression ratio are checked while streaming, so a
  decompression bomb stops early instead of filling the disk;
* everything is unpacked into a hidden staging folder inside the destination and moved into
  place only when the whole archive succeeded: a failure leaves the destination as it was.

Tar archives are read in stream mode: memory stays bounded whatever the size. Every check the
container format carries is verified before anything is moved into place: the compressed
stream is read to its end (gzip CRC-32 and ISIZE, xz/zstd checksums, bzip2 block CRCs; see
``modelcache.sources.compression``), and each zip entry is read to its end, where ``zipfile`` compares
its CRC-32.
"""

from __future__ import annotations

import os
import shutil
import stat
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from modelcache.errors import ModelcacheError

if TYPE_CHECKING:
    import tarfile

#: ``.taz`` and ``.tz`` are gzip tars to Python's mimetypes, so KServe unpacks them (audit C30).
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".taz", ".tz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst",
                ".tzst")
ZIP_SUFFIXES = (".zip",)

#: KServe's wording for a broken archive, kept so existing alerts and runbooks still match.
INVALID_FORMAT = "Failed to unpack archive file. The file format is not valid."

_COPY_BUFFER = 1 << 20
_MAX_SYMLINK_TARGET = 4096
_STAGING_PREFIX = ".modelcache-unpack-"


class ArchiveError(ModelcacheError):
    """The archive is corrupt or not an archive at all."""

    reason = "InvalidArchive"


class UnsafeArchiveError(ArchiveError):
    """The archive tries to write outside the destination, or holds a device file or FIFO."""

    reason = "UnsafeArchive"


class ArchiveLimitError(ArchiveError):
    """The archive exceeds a cap (bytes, entries, ratio): likely a decompression bomb."""

    reason = "ArchiveTooLarge"


@dataclass(frozen=True)
class ArchiveLimits:
    """Caps that stop a decompression bomb; defaults are far above any real model archive."""

    max_bytes: int = 2 << 40  # 2 TiB unpacked
    max_entries: int = 1_000_000
    #: Unpacked bytes / archive bytes. Real weights compress by less than 2x; 200x is a bomb.
    max_ratio: float = 200.0
    #: The ratio is only enforced past this many unpacked bytes, so tiny archives of text
    #: (configs, tokenizers) that compress very well are never refused.
    ratio_min_bytes: int = 1 << 20

    ENV = {
        "max_bytes": "MODELCACHE_ARCHIVE_MAX_BYTES",
        "max_entries": "MODELCACHE_ARCHIVE_MAX_ENTRIES",
        "max_ratio": "MODELCACHE_ARCHIVE_MAX_RATIO",
    }

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ArchiveLimits:
        """Read the caps from an environment snapshot (``Settings.env``); unset keeps the default."""
        values: dict[str, float | int] = {}
        for attr, name in cls.ENV.items():
            raw = (env.get(name) or "").strip()
            if not raw:
                continue
            try:
                number = float(raw) if attr == "max_ratio" else int(raw)
            except ValueError:
                raise ModelcacheError(f"environment variable {name}={raw!r} is not a number") from None
            if number <= 0:
                raise ModelcacheError(f"environment variable {name}={raw!r} must be positive")
            values[attr] = number
        return cls(**values)  # type: ignore[arg-type]


def archive_kind(name: str) -> str | None:
    """``"tar"``, ``"zip"`` or None, from the file name (as KServe does, via its mimetype)."""
    suffix = archive_suffix(name)
    return None if suffix is None else "zip" if suffix in ZIP_SUFFIXES else "tar"


def archive_suffix(name: str) -> str | None:
    """The archive suffix ``name`` ends with (the longest: ``.tar.gz`` before ``.gz``), or None."""
    lower = name.lower()
    found = [s for s in (*ZIP_SUFFIXES, *TAR_SUFFIXES) if lower.endswith(s)]
    return max(found, key=len) if found else None


def single_archive(paths: list[str]) -> str | None:
    """KServe's rule: a model that is exactly one file, an archive by its name, is unpacked
    (its initializer does it after every download, so its node cache Job does too)."""
    return paths[0] if len(paths) == 1 and archive_kind(paths[0]) is not None else None


@dataclass
class UnpackResult:
    files: int = 0
    bytes: int = 0
    entries: int = 0
    symlinks: int = 0
    paths: list[str] = field(default_factory=list)


def unpack_archive(
    archive: Path,
    dest: Path,
    limits: ArchiveLimits | None = None,
    *,
    remove_archive: bool = True,
    reserved: tuple[str, ...] = (),
    on_bytes: Callable[[int], None] | None = None,
) -> UnpackResult:
    """Unpack ``archive`` into ``dest`` safely, then delete the archive.

    ``reserved`` lists top-level names the archive may not write (our own bookkeeping). On any
    error ``dest`` is left exactly as it was (the archive included) and an ``ArchiveError``
    naming the archive is raised. ``on_bytes(n)`` is called as unpacked bytes are written.
    """
    # Imported here, not at the top: every pull asks single_archive() about its listing, few
    # unpack, and tarfile, zipfile and the compressors cost every CLI start ~10 ms (issue 28).
    import tarfile
    import uuid
    import zipfile

    limits = limits or ArchiveLimits()
    kind = archive_kind(archive.name)
    if kind is None:
        raise ArchiveError(f"{INVALID_FORMAT} ({archive.name}: not a .tar, .tar.gz, .tgz or .zip file)")
    dest.mkdir(parents=True, exist_ok=True)
    staging = dest / f"{_STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        writer = _StagingWriter(staging, archive, limits, reserved, on_bytes)
        try:
            if kind == "zip":
                _unpack_zip(archive, writer)
            else:
                _unpack_tar(archive, writer)
        except ModelcacheError:
            raise
        # NotImplementedError: zipfile on a compression method, version or flag it lacks (also
        # what a damaged header announces).
        except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError,
                NotImplementedError) as exc:
            if isinstance(exc, OSError) and not _is_format_oserror(exc):
                raise ArchiveError(f"failed to unpack {archive.name} into {dest}: {exc.strerror or exc}") from exc
            raise ArchiveError(f"{INVALID_FORMAT} ({archive.name}: {_short(exc)})") from exc
        writer.finish_links()
        replaced = archive.parent == dest and os.path.lexists(staging / archive.name)
        # Merge first, then drop the archive: a crash in between leaves the archive to redo
        # the (idempotent) unpack, never a destination without the archive or its contents.
        _merge_into(staging, dest)
        if remove_archive and not replaced:
            archive.unlink()
        return writer.result
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _is_format_oserror(exc: OSError) -> bool:
    # gzip.BadGzipFile and lzma.LZMAError subclass OSError but mean "corrupt", not "disk".
    import gzip
    import lzma

    return isinstance(exc, gzip.BadGzipFile | lzma.LZMAError) or (exc.errno is None and not exc.filename)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


class _StagingWriter:
    """Writes entries under ``root``; links are deferred; caps are enforced as bytes arrive."""

    def __init__(
        self,
        root: Path,
        archive: Path,
        limits: ArchiveLimits,
        reserved: tuple[str, ...],
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.on_bytes = on_bytes
        self.root = root
        self.real_root = os.path.realpath(root)
        self.name = archive.name
        self.limits = limits
        self.archive_size = max(archive.stat().st_size, 1)
        self.reserved = set(reserved)
        self.result = UnpackResult()
        self._symlinks: list[tuple[str, str]] = []
        self._regular: set[str] = set()
        self._deferred_names: set[str] = set()

    # -- validation ---------------------------------------------------------------------

    def unsafe(self, entry: str, why: str) -> UnsafeArchiveError:
        return UnsafeArchiveError(f"refusing to unpack {self.name}: entry {entry!r} {why}")

    def entry_path(self, raw: str) -> str | None:
        """The normalised relative path of an entry, None for the archive root itself."""
        if "\x00" in raw:
            raise self.unsafe(raw, "has a NUL byte in its name")
        if raw.startswith("/") or (len(raw) > 1 and raw[1] == ":" and raw[0].isalpha()):
            raise self.unsafe(raw, "has an absolute path")
        parts = [p for p in raw.replace("\\", "/").split("/") if p not in ("", ".")]
        if ".." in parts:
            raise self.unsafe(raw, "has '..' in its path (outside the destination)")
        if not parts:
            return None
        if parts[0] in self.reserved or parts[0].startswith(_STAGING_PREFIX):
            raise self.unsafe(raw, "uses a name reserved by modelcache")
        return "/".join(parts)

    def too_many_entries(self) -> ArchiveLimitError:
        return ArchiveLimitError(
            f"refusing to unpack {self.name}: more than {self.limits.max_entries} entries "
            "(raise MODELCACHE_ARCHIVE_MAX_ENTRIES if this archive is genuine)"
        )

    def too_many_bytes(self) -> ArchiveLimitError:
        return ArchiveLimitError(
            f"refusing to unpack {self.name}: it unpacks to more than {self.limits.max_bytes} bytes "
            "(raise MODELCACHE_ARCHIVE_MAX_BYTES if this archive is genuine)"
        )

    def count_entry(self) -> None:
        self.result.entries += 1
        if self.result.entries > self.limits.max_entries:
            raise self.too_many_entries()

    def _add_bytes(self, n: int) -> None:
        total = self.result.bytes + n
        if total > self.limits.max_bytes:
            raise self.too_many_bytes()
        if total > self.limits.ratio_min_bytes and total / self.archive_size > self.limits.max_ratio:
            raise ArchiveLimitError(
                f"refusing to unpack {self.name}: compression ratio above {self.limits.max_ratio:g} "
                f"({total} bytes from a {self.archive_size}-byte archive; a decompression bomb? "
                "raise MODELCACHE_ARCHIVE_MAX_RATIO if this archive is genuine)"
            )
        self.result.bytes = total
        if self.on_bytes is not None:
            self.on_bytes(n)

    def add_trailing(self, n: int) -> None:
        """Bytes decompressed after the tar's end: not written, but a bomb all the same."""
        self._add_bytes(n)

    def check_declared_size(self, size: int) -> None:
        """Fail before writing when a header already says the entry is over the byte cap."""
        if self.result.bytes + size > self.limits.max_bytes:
            raise self.too_many_bytes()

    # -- writing ------------------------------------------------------------------------

    def _prepare(self, rel: str) -> str:
        """Absolute staging path for ``rel``, parents created. No symlink exists in staging yet,
        so nothing here can be redirected outside it."""
        if rel in self._deferred_names:
            raise self.unsafe(rel, "is both a link and a file or directory")
        path = os.path.join(self.root, rel)
        parent = os.path.dirname(path)
        try:
            os.makedirs(parent, mode=0o755, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise self.unsafe(rel, "is inside a path the archive made a file") from None
        return path

    def _clear_file(self, path: str, rel: str) -> None:
        """A later entry with the same name replaces a file (tar semantics), never a directory."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise self.unsafe(rel, "replaces a directory of the same archive")
        os.unlink(path)

    def add_dir(self, rel: str) -> None:
        path = self._prepare(rel)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise self.unsafe(rel, "replaces a file of the same archive with a directory")
        os.makedirs(path, mode=0o755, exist_ok=True)

    def add_file(self, rel: str, stream: IO[bytes], mode: int) -> None:
        path = self._prepare(rel)
        self._clear_file(path, rel)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        buf = bytearray(_COPY_BUFFER)
        view = memoryview(buf)
        try:
            while True:
                n = stream.readinto(view)  # type: ignore[attr-defined]
                if not n:
                    break
                self._add_bytes(n)
                _write_all(fd, view[:n])
            # Data-filter style permissions: owner read/write, exec only if the entry had it.
            os.fchmod(fd, 0o755 if mode & 0o111 else 0o644)
        finally:
            os.close(fd)
        self._regular.add(rel)
        self.result.files += 1
        self.result.paths.append(rel)

    def add_hardlink(self, rel: str, raw_target: str) -> None:
        parts = [p for p in raw_target.split("/") if p not in ("", ".")]
        if raw_target.startswith("/") or ".." in parts or not parts:
            raise self.unsafe(rel, f"is a hardlink to {raw_target!r}, outside the destination")
        target = "/".join(parts)
        if target not in self._regular:
            raise self.unsafe(rel, f"is a hardlink to {raw_target!r}, which is not a file of this archive")
        path = self._prepare(rel)
        self._clear_file(path, rel)
        os.link(os.path.join(self.root, target), path, follow_symlinks=False)
        self._regular.add(rel)
        self.result.files += 1
        self.result.paths.append(rel)

    def add_symlink(self, rel: str, target: str) -> None:
        if not target or "\x00" in target:
            raise self.unsafe(rel, "is a symlink with an empty target")
        if target.startswith("/"):
            raise self.unsafe(rel, f"is a symlink to the absolute path {target!r}")
        lexical = os.path.normpath(os.path.join(os.path.dirname(rel), target))
        if lexical == ".." or lexical.startswith("../"):
            raise self.unsafe(rel, f"is a symlink to {target!r}, outside the destination")
        if rel in self._regular:
            self._regular.discard(rel)  # a later entry replaces the earlier file
        self._deferred_names.add(rel)
        self._symlinks.append((rel, target))

    def finish_links(self) -> None:
        """Create deferred symlinks, then prove that every one resolves inside the root."""
        for rel, target in self._symlinks:
            parent = os.path.realpath(os.path.join(self.root, os.path.dirname(rel)))
            if not _inside(parent, self.real_root):
                raise self.unsafe(rel, "is reached through a symlink that leaves the destination")
            os.makedirs(parent, mode=0o755, exist_ok=True)
            path = os.path.join(parent, os.path.basename(rel))
            if os.path.lexists(path):
                if os.path.isdir(path) and not os.path.islink(path):
                    raise self.unsafe(rel, "is a symlink that replaces a directory of the same archive")
                os.unlink(path)
            os.symlink(target, path)
        for rel, target in self._symlinks:
            if not _inside(os.path.realpath(os.path.join(self.root, rel)), self.real_root):
                raise self.unsafe(rel, f"is a symlink to {target!r}, which resolves outside the destination")
        self.result.symlinks = len(self._symlinks)
        self.result.paths.extend(rel for rel, _ in self._symlinks)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _unpack_tar(archive: Path, w: _StagingWriter) -> None:
    # Stream mode: one pass, no seeking, bounded memory even for a 100 GiB .tar.gz. The stream
    # is read to its end after the last entry, so the gzip CRC/ISIZE (or xz/zstd/bzip2 check)
    # is verified before anything is moved into place; bytes after the tar count against the caps.
    from modelcache.sources.compression import verified_tar

    with open(archive, "rb") as raw, verified_tar(raw, on_trailing=w.add_trailing) as tf:
        for member in _iter_tar(tf):
            w.count_entry()
            rel = w.entry_path(member.name)
            if member.ischr() or member.isblk():
                raise w.unsafe(member.name, "is a device file")
            if member.isfifo():
                raise w.unsafe(member.name, "is a FIFO")
            if rel is None:
                continue  # "./": the archive root itself
            if member.isdir():
                w.add_dir(rel)
            elif member.issym():
                w.add_symlink(rel, member.linkname)
            elif member.islnk():
                w.add_hardlink(rel, member.linkname)
            elif member.isreg():
                w.check_declared_size(member.size)
                stream = tf.extractfile(member)
                assert stream is not None
                with stream:
                    w.add_file(rel, stream, member.mode)
            else:
                raise w.unsafe(member.name, f"has an unsupported type {member.type!r}")


def _iter_tar(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while True:
        member = tf.next()
        if member is None:
            return
        yield member


def _unpack_zip(archive: Path, w: _StagingWriter) -> None:
    import zipfile

    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        if not infos:
            # An empty central directory is a valid but useless zip; KServe would unpack nothing.
            return
        # The central directory is known up front: refuse an obvious bomb before writing a byte.
        if len(infos) > w.limits.max_entries:
            raise w.too_many_entries()
        w.check_declared_size(sum(i.file_size for i in infos))
        for info in infos:
            w.count_entry()
            rel = w.entry_path(info.filename)
            if info.flag_bits & 0x1:
                raise ArchiveError(f"{INVALID_FORMAT} ({w.name}: entry {info.filename!r} is encrypted)")
            unix_mode = info.external_attr >> 16
            kind = stat.S_IFMT(unix_mode) if unix_mode else 0
            if kind in (stat.S_IFCHR, stat.S_IFBLK):
                raise w.unsafe(info.filename, "is a device file")
            if kind in (stat.S_IFIFO, stat.S_IFSOCK):
                raise w.unsafe(info.filename, "is a FIFO or socket")
            if rel is None:
                continue
            if info.is_dir() or kind == stat.S_IFDIR:
                w.add_dir(rel)
            elif kind == stat.S_IFLNK:
                if info.file_size > _MAX_SYMLINK_TARGET:
                    raise w.unsafe(info.filename, "is a symlink with an oversized target")
                w.add_symlink(rel, zf.read(info).decode("utf-8", "surrogateescape"))
            else:
                with zf.open(info) as stream:
                    w.add_file(rel, stream, unix_mode)


def _merge_into(staging: Path, dest: Path) -> None:
    """Move the unpacked tree into ``dest``: KServe overwrites existing files, and so do we.

    Renames only (same filesystem). An existing symlink in ``dest`` is replaced, never
    followed, so a pre-existing link cannot redirect the archive's files elsewhere.
    """
    for name in os.listdir(staging):
        src = staging / name
        dst = dest / name
        try:
            dst_st = os.lstat(dst)
        except FileNotFoundError:
            os.replace(src, dst)
            continue
        src_is_dir = stat.S_ISDIR(os.lstat(src).st_mode)
        if src_is_dir and stat.S_ISDIR(dst_st.st_mode):
            _merge_into(src, dst)
            continue
        if stat.S_ISDIR(dst_st.st_mode):
            shutil.rmtree(dst)
        else:
            os.unlink(dst)
        os.replace(src, dst)


def remove_stale_staging(dest: Path) -> None:
    """Remove unpack staging folders a killed process left in ``dest``."""
    if not dest.is_dir():
        return
    for entry in dest.iterdir():
        if entry.name.startswith(_STAGING_PREFIX) and entry.is_dir() and not entry.is_symlink():
            with suppress(OSError):
                shutil.rmtree(entry)
