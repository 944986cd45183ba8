"""The store's locks: one writer per model per machine (``model_lock``), one agent per node
root (``RootLock``). Both are ``flock``: the kernel releases them when the process ends,
however it ends."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from modelcache.errors import CancelledError, ModelInUseError
from modelcache.store.diskio import store_error
from modelcache.store.layout import NodeLayout
from modelcache.store.lockscope import check_exclusive

log = logging.getLogger("modelcache.store")


def _holder(fd: int) -> str:
    """" (pid N)" from a lock file its holder wrote its pid into, else ""."""
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (pid {text})" if text.isdigit() else ""


def _same_file(fd: int, path: Path) -> bool:
    """The open lock file is still the one at ``path`` (not unlinked by a remover meanwhile)."""
    try:
        st, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _flock_until(fd: int, cancel: threading.Event, key: str, poll: float = 0.1) -> None:
    while True:
        if cancel.is_set():
            raise CancelledError(f"model {key}: cancelled while waiting for another modelcache process to finish it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            cancel.wait(poll)


def _open_lock(path: Path) -> tuple[int, bool]:
    """The lock file, opened for writing (created if missing), or read-only where the store is."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644), True
    except OSError as exc:
        try:  # a read-only store still locks through an existing lock file (flock needs no write)
            return os.open(path, os.O_RDONLY), False
        except OSError:
            raise store_error(exc, str(path), "locking") from exc


@contextlib.contextmanager
def model_lock(path: Path, base: Path, key: str, blocking: bool = True, cancel: threading.Event | None = None,
               on_wait: Callable[[str], None] | None = None,
               on_release: Callable[[], bool] | None = None) -> Iterator[None]:
    """Exclusive lock on ``path`` for model ``key`` of the store at ``base`` (``NodeStore.lock``
    says what it promises). ``on_release``, asked while the lock is still held: True when
    nothing of the model is left, and the lock file goes too."""
    check_exclusive(base)  # flock that other hosts ignore would exclude nothing
    told = False
    while True:
        fd, writable = _open_lock(path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                if not blocking:
                    raise ModelInUseError(
                        f"model {key} is in use by another modelcache process{_holder(fd)} (a pull or rm); "
                        "retry when it is done"
                    ) from exc
                if on_wait is not None and not told:
                    told = True
                    on_wait(f"waiting for another modelcache process{_holder(fd)} that holds model {key} "
                            "(a pull or rm of the same URI) to finish")
                if cancel is not None:
                    _flock_until(fd, cancel, key)
                else:
                    fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        if not _same_file(fd, path):
            # The holder we waited for removed the model and unlinked this lock file: a lock on
            # it excludes nobody who opens the path now. Lock the file that is there instead.
            os.close(fd)
            continue
        break
    try:
        if writable:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        if writable and on_release is not None and on_release():
            # Unlinked while held (every locker checks that the file it locked is still the one
            # at the path), so locks do not pile up.
            with contextlib.suppress(OSError):
                path.unlink()
        os.close(fd)


def busy(path: Path) -> bool:
    """Another process holds the lock at ``path`` right now. Creates nothing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class RootLock:
    """One agent per node root: ``flock`` on the root's ``agent.lock`` (released by the kernel
    when the process ends, however it ends). Two agents for one node (a rollout with
    ``maxSurge``, a force-deleted pod whose container still runs) would both download, delete
    and report; the second waits politely instead, and takes over when the first exits."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = NodeLayout(self.root).root_lock_path()
        self._fd: int | None = None

    def holder(self) -> str:
        """What the holding agent wrote into the lock file (its pid), for the log."""
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def acquire(self, stop: threading.Event, poll: float = 1.0) -> bool:
        """Take the lock, waiting while another agent holds it; False if ``stop`` came first."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise store_error(exc, str(self.path), "locking the root") from exc
        waiting = False
        while not stop.is_set():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waiting:
                    waiting = True
                    log.warning("another agent is running on this root: waiting for it to stop",
                                extra={"fields": {"root": str(self.root), "holder_pid": self.holder()}})
                stop.wait(poll)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._fd = fd
            if waiting:
                log.info("the other agent stopped: taking over", extra={"fields": {"root": str(self.root)}})
            return True
        os.close(fd)
        return False

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
