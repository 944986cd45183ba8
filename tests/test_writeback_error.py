"""A write-back error is final for the file: never published, never resumed (issue 20, point 1).

Linux reports a write-back error (EIO, ENOSPC on a thin or over-committed device) once per open
file description: the first fsync/fdatasync after it fails, later ones on the same descriptor
return 0. The engine's sync thread caught that first error and only skipped its journal mark,
so the final fsync returned 0 and the file was published with zeros where write-back failed;
a resume in the same boot then hashed those zeros from disk and published them too.

The real-kernel test builds the failing device itself: an ext4 file system on a loop device whose
backing file lives on a small tmpfs. Its metadata blocks are allocated up front, its data blocks
are holes; with the tmpfs filled, writing the data back fails with ENOSPC (as a thin pool that ran
out of space does). A wrapper around ``os.fdatasync`` frees the tmpfs after the first failure, the
transient case (the pool was grown) in which a later fsync succeeds. The bytes are read back after
a remount, which drops the page cache. Device-mapper (dm-flakey, dm-error) is not in this kernel
(``dmsetup``: "/dev/mapper/control: open failed: No such device"), hence the loop device.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from modelcache.engine.transfer import TransferOptions
from modelcache.errors import StoreError
from modelcache.pull import pull
from modelcache.sources.credentials import Settings
from modelcache.sources.local import _FileStream
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from modelcache.store.journal import unseal
from tests.fixtures.http import random_bytes
from tests.helpers import require, require_tool

MiB = 1 << 20
SIZE = 24 * MiB
HOLD_FROM = 16 * MiB  # the source holds reads from here until a flush has failed
OPTIONS = TransferOptions(workers=1, chunk_size=4 * MiB, direct_io=False, sync_interval=0.05,
                          max_attempts=2, backoff_initial=0.01, backoff_max=0.02)


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


@dataclass
class ThinExt4:
    """ext4 on a loop device whose backing store (a tmpfs) can be made to run out of space."""

    mnt: Path
    backing: Path
    loop: str

    @property
    def filler(self) -> Path:
        return self.backing / "filler"

    def fill(self, leave: int) -> None:
        st = os.statvfs(self.backing)
        free = st.f_bavail * st.f_frsize
        with open(self.filler, "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(0, free - leave))

    def free_filler(self) -> None:
        self.filler.unlink(missing_ok=True)

    def remount(self) -> None:
        """Unmount and mount again: later reads come from the device, not the page cache."""
        _run("umount", str(self.mnt))
        _run("mount", "-o", "errors=continue", self.loop, str(self.mnt))


@pytest.fixture
def thin_ext4(tmp_path: Path) -> Iterator[ThinExt4]:
    require(os.geteuid() == 0, "root (to mount a loop device)")
    for tool in ("losetup", "mkfs.ext4", "dumpe2fs", "fallocate", "mount", "umount"):
        require_tool(tool, "/sbin", "/usr/sbin")
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    _run("mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(backing))
    loop = ""
    mounted = False
    try:
        img = backing / "disk.img"
        _run("truncate", "-s", "128M", str(img))
        # One block group, a small inode table and journal: all metadata sits in the first
        # few MiB, which are allocated now; the data blocks stay holes in the tmpfs.
        _run("mkfs.ext4", "-q", "-F", "-b", "4096", "-N", "1024", "-J", "size=4",
             "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard", str(img))
        m = re.search(r"^\s+Free blocks: (\d+)-", _run("dumpe2fs", str(img)), re.M)  # group 0's
        first_free = int(m.group(1)) if m else 1 << 30
        assert first_free * 4096 <= 8 * MiB, f"ext4 metadata ends at block {first_free}, past the allocated 8 MiB"
        _run("fallocate", "-l", str(8 * MiB), str(img))
        loop = _run("losetup", "--find", "--show", str(img)).strip()
        require(loop.startswith("/dev/loop"), "a free loop device")
        _run("mount", "-o", "errors=continue", loop, str(mnt))
        mounted = True
        yield ThinExt4(mnt, backing, loop)
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], capture_output=True)
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        subprocess.run(["umount", "-l", str(backing)], capture_output=True)


def _hold_reads_until(event: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """The source delivers the first HOLD_FROM bytes, then waits until a flush has failed (the
    failure happens while the download is running, not after its last byte). The hold is in the
    stream's reads, not at its opening: the engine reads a run of chunks through one stream, so
    a file can be a single ``open_range(0, ...)``."""
    real = _FileStream.readinto

    def readinto(self: _FileStream, buf: memoryview) -> int:
        if self._pos >= HOLD_FROM:
            event.wait(60)
        return real(self, buf)

    monkeypatch.setattr(_FileStream, "readinto", readinto)


def _journal(root: Path, uri: str) -> str:
    """The journal's lines without their seals (lines that fail theirs dropped, as load does)."""
    text = (root / ".modelcache" / "staging" / storage_key(uri) / "journal").read_text()
    return "\n" + "\n".join(ln for ln in map(unseal, text.split("\n")) if ln) + "\n"


def test_write_back_enospc_on_a_thin_device_fails_the_file_and_the_resume_refetches_it(
    thin_ext4: ThinExt4, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random_bytes(SIZE, seed=41)
    src = tmp_path / "src" / "w.bin"
    src.parent.mkdir()
    src.write_bytes(data)
    uri = f"file://{src}"
    root = thin_ext4.mnt / "root"
    (root / ".modelcache" / "staging").mkdir(parents=True)
    os.sync()
    thin_ext4.fill(leave=4 * MiB)

    failed = threading.Event()
    flushes: list[str] = []
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        try:
            real_fdatasync(fd)
            flushes.append("ok")
        except OSError as exc:
            flushes.append(errno.errorcode.get(exc.errno or 0, str(exc.errno)))
            thin_ext4.free_filler()  # the pool was grown: the next flush on this descriptor succeeds
            failed.set()
            raise

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    _hold_reads_until(failed, monkeypatch)
    with pytest.raises(StoreError, match=r"flushing .* to disk"):
        pull(uri, root=root, settings=Settings.from_env({}), options=OPTIONS)
    assert failed.is_set(), f"no flush failed (flushes: {flushes}): the device did not run out of space"
    assert not NodeStore.at(root).is_present(storage_key(uri))
    assert "\nR 0\n" in _journal(root, uri), "the journal still vouches for the lost pieces"

    # The space is back: the next pull fetches the file again instead of resuming from the zeros.
    monkeypatch.undo()
    pull(uri, root=root, settings=Settings.from_env({}), options=OPTIONS)
    thin_ext4.remount()
    published = root / "models" / storage_key(uri) / "w.bin"
    got = published.read_bytes()
    bad = [i for i in range(0, SIZE, MiB) if got[i : i + MiB] != data[i : i + MiB]]
    assert not bad, f"MiB blocks that differ from the source after a remount: {[b // MiB for b in bad]}"
    assert NodeStore.at(root).verify(storage_key(uri)) == []


def test_a_failed_flush_is_never_followed_by_a_publish_or_a_resume_of_the_lost_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rule without root: the sync thread's fdatasync fails once with EIO (as the kernel
    reports a write-back error: once per descriptor), every later flush succeeds."""
    data = random_bytes(SIZE, seed=42)
    src = tmp_path / "src" / "w.bin"
    src.parent.mkdir()
    src.write_bytes(data)
    uri = f"file://{src}"
    root = tmp_path / "root"
    failed = threading.Event()
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        if not failed.is_set() and "/staging/" in os.readlink(f"/proc/self/fd/{fd}"):
            failed.set()
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    _hold_reads_until(failed, monkeypatch)
    with pytest.raises(StoreError, match=r"flushing .* failed \(Input/output error\)"):
        pull(uri, root=root, settings=Settings.from_env({}), options=OPTIONS)
    journal = _journal(root, uri)
    assert "\nR 0\n" in journal
    after_reset = journal.split("\nR 0\n", 1)[1]
    assert not any(line.startswith(("c 0 ", "F 0 ")) for line in after_reset.splitlines()), after_reset

    monkeypatch.undo()
    res = pull(uri, root=root, settings=Settings.from_env({}), options=OPTIONS)
    assert (res.path / "w.bin").read_bytes() == data
