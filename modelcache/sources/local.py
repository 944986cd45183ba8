"""Local files: ``file://``, absolute paths, and ``pvc://claim/path`` under the PVC mount root.

Read through the same engine as remote sources (a copy, chunked and hashed), so a store
entry never depends on a path that may go away. The initializer links instead, as KServe does.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

from modelcache.errors import AccessDeniedError, NotFoundError, SourceChangedError, SourceError, UnsupportedError
from modelcache.runtime.reserved import META_DIR
from modelcache.sources.base import RemoteFile, Source, safe_relpath
from modelcache.sources.uri import LocalLocation, Location, PVCLocation

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device"}


class NotAFileError(UnsupportedError):
    reason = "NotARegularFile"


def check_file_type(path: str | os.PathLike[str], mode: int, where: str) -> None:
    """The one check of what a local source may be: a regular file or a directory.

    A FIFO or a character device would block for ever or stream endless bytes, and a socket
    cannot be read at all; each is refused by name instead of being copied.
    """
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    raise NotAFileError(
        f"{where}: '{path}' is {kind}; only regular files and directories can be model sources"
    )


class _FileStream:
    def __init__(self, path: str, start: int, end: int | None, where: str = "") -> None:
        # O_NONBLOCK: if the path was swapped for a FIFO since the listing, open must not hang
        # waiting for a writer; the type is checked on what was opened (no race with a stat).
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            check_file_type(path, os.fstat(self._fd).st_mode, where or path)
        except BaseException:
            os.close(self._fd)
            raise
        self._pos = start
        self._end = end
        self._lock = threading.Lock()

    def readinto(self, buf: memoryview) -> int:
        want = len(buf) if self._end is None else min(len(buf), self._end - self._pos)
        if want <= 0:
            return 0
        n = os.preadv(self._fd, [buf[:want]], self._pos)
        self._pos += n
        return n

    def abort(self) -> None:
        self.close()  # preadv does not block on a regular file: closing is enough

    def close(self) -> None:
        # The watchdog or a cancel closes from another thread while the worker may close too:
        # the number is taken out under a lock before it is closed, so it is closed once. (Two
        # closes could hit a number the kernel had meanwhile given to a file being written.)
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def resolve_local_path(location: Location, settings: Any) -> Path:
    if isinstance(location, PVCLocation):
        return Path(settings.local.pvc_root) / location.claim / location.path
    assert isinstance(location, LocalLocation)
    return Path(location.path)


class LocalSource(Source):
    max_streams = 16

    def __init__(self, location: Location, settings: Any) -> None:
        super().__init__(location, settings)
        self.root = resolve_local_path(location, settings)

    def list_files(self) -> list[RemoteFile]:
        where = self.location.display
        try:
            st = self.root.stat()
        except FileNotFoundError as exc:
            hint = (
                f" (PVCs are mounted under {self.settings.local.pvc_root})"
                if isinstance(self.location, PVCLocation)
                else ""
            )
            raise NotFoundError(f"{where}: no such file or directory '{self.root}'{hint}") from exc
        except PermissionError as exc:
            raise AccessDeniedError(f"{where}: permission denied reading '{self.root}'") from exc
        check_file_type(self.root, st.st_mode, where)
        if not self.root.is_dir():
            return [self._file(self.root, self.root.name, st)]
        files = []
        for dirpath, dirnames, filenames in os.walk(self.root, onerror=self._walk_error):
            dirnames[:] = sorted(d for d in dirnames if d != META_DIR)  # a store's bookkeeping, not the model
            for name in sorted(filenames):
                full = Path(dirpath) / name
                rel = full.relative_to(self.root).as_posix()
                try:
                    fst = full.stat()
                except OSError:
                    continue  # a dangling symlink: nothing to copy
                check_file_type(full, fst.st_mode, where)
                files.append(self._file(full, rel, fst))
        if not files:
            raise NotFoundError(f"{where}: '{self.root}' holds no files")
        return files

    def _walk_error(self, exc: OSError) -> None:
        raise SourceError(f"{self.location.display}: cannot list '{exc.filename}': {exc.strerror}")

    def _file(self, full: Path, rel: str, st: os.stat_result) -> RemoteFile:
        path = safe_relpath(rel, self.location.display)
        return RemoteFile(path=path, size=st.st_size, version=_identity(st), meta=(("local_path", str(full)),))

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> _FileStream:
        try:
            return _FileStream(file.meta_get("local_path"), start, end, self.location.display)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{self.location.display}: '{file.path}' disappeared during the copy") from exc

    def check_unchanged(self, file: RemoteFile) -> None:
        """A file has no revision here: it is stat'ed again once copied. A write in place (same
        size, even with its mtime put back) changes its ctime; a replacement, its inode."""
        try:
            now = _identity(os.stat(file.meta_get("local_path")))
        except FileNotFoundError:
            now = "gone"
        if now != file.version:
            raise SourceChangedError(
                f"{self.location.display}: '{file.path}' changed during the copy (its size, times or inode "
                "differ from the listing); pull again once nothing writes it"
            )


def _identity(st: os.stat_result) -> str:
    """The listed version of a local file: what any write to it, or a replacement, changes. Also
    the resume key (plan.json): a same-size copy with its mtime kept (``cp -p``) is a new inode."""
    return f"{st.st_mtime_ns}-{st.st_size}-{st.st_ino}-{st.st_ctime_ns}"
