"""The resume journal: which byte ranges of a staged download are already on disk.

An append-only text file in the model's staging folder. Lines are appended as pieces land
(so a killed process loses at most the pieces in flight); every few seconds the engine
fdatasyncs the data files and appends a sync marker. After a reboot (the kernel's boot id
changed) only lines before the last marker are trusted, since later ones may describe data
that never reached the disk. Each line is one small ``write`` on an O_APPEND descriptor, so a
crash leaves at worst one torn last line, which is ignored.

Lines:  ``boot <id>``, ``c <file> <chunk> <done>``, ``F <file> <xxh3> <algo,algo>``, ``R <file>``,
``S <n>``, each sealed with `` *<crc32>`` of the rest of the line. A line whose seal does not
match (a flipped bit, a torn or garbled write, a journal of an older version) is dropped as a
torn line is: its piece is fetched again, never trusted. Without the seal a single damaged digit
could mark an unfetched chunk done, or give one file another's finished state. ``R`` (a file
fetched again, or whose write-back failed) drops every earlier line of the file.

A sync mark covers the first ``n`` lines of its segment (those written before the
fdatasync began: lines appended while it ran may describe data it missed); a bare ``S`` (older
journals) covers every line before it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import zlib
from dataclasses import dataclass, field
from typing import Protocol

from modelcache.errors import ModelcacheError
from modelcache.store.diskio import store_error

log = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
#: Written as the boot id when none can be read. It never counts as "this boot" (below): a
#: fallback shared by every boot would make each later boot trust the unsynced lines of the
#: last, and resume zeros that never reached the disk as data.
UNKNOWN_BOOT = "unknown"


def seal(text: str) -> str:
    """Append `` *<crc32>`` to every line of ``text`` (lines end in newlines; blank ones stay)."""
    out = []
    for line in text.split("\n")[:-1]:
        out.append(f"{line} *{zlib.crc32(line.encode()):08x}" if line else "")
    return "\n".join(out) + "\n"


def unseal(line: str) -> str | None:
    """The line without its seal, or None when the seal is missing or does not match."""
    body, sep, crc = line.rpartition(" *")
    if not sep or len(crc) != 8:
        return None
    try:
        ok = int(crc, 16) == zlib.crc32(body.encode("utf-8", "surrogateescape"))
    except ValueError:
        return None
    return body if ok else None


def boot_id() -> str | None:
    """This boot's id, or None where it cannot be read (a restricted /proc, some sandboxes)."""
    try:
        with open(BOOT_ID_PATH) as f:
            value = f.read().strip()
    except OSError:
        return None
    return value or None


@dataclass
class JournalState:
    chunks: dict[tuple[int, int], int] = field(default_factory=dict)  # (file, chunk) -> bytes done
    files: dict[int, tuple[str, tuple[str, ...]]] = field(default_factory=dict)  # file -> (xxh3, verified)


def _trusted(lines: list[str], current_boot: str | None) -> list[str]:
    """Each run starts a ``boot`` segment; a segment from another boot counts up to its last sync.

    Without a readable boot id (``current_boot`` None, or a segment written as ``unknown``) no
    segment is known to be from this boot: only its sync marks count.
    """
    out: list[str] = []
    segment: list[str] = []
    seg_boot = ""

    def flush() -> None:
        if current_boot is not None and seg_boot == current_boot and seg_boot != UNKNOWN_BOOT:
            out.extend(segment)
            return
        covered = 0
        for i, ln in enumerate(segment):
            if ln == "S":
                covered = max(covered, i + 1)
            elif ln.startswith("S "):
                try:
                    covered = max(covered, min(int(ln[2:]), i))
                except ValueError:
                    continue
        out.extend(segment[:covered])

    for line in lines:
        if line.startswith("boot "):
            flush()
            segment, seg_boot = [], line[5:]
        else:
            segment.append(line)
    flush()
    return out


class JournalListener(Protocol):
    """Told what the journal records, after it is recorded (peers serve pieces only once the
    engine wrote them). Called from the engine's threads: must be quick and must not raise."""

    def chunk(self, file_idx: int, chunk_idx: int, done: int) -> None: ...

    def file_done(self, file_idx: int) -> None: ...

    def file_reset(self, file_idx: int) -> None: ...


class Journal:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = -1
        self._lines = 0  # lines written in this run's segment (after its boot line)
        self._lost: set[int] = set()  # files whose write-back failed in this run
        self.listener: JournalListener | None = None

    def load(self) -> JournalState:
        """Read what earlier runs recorded; trust unsynced lines only within the same boot."""
        state = JournalState()
        try:
            with open(self.path, encoding="utf-8", errors="surrogateescape") as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            return state
        if lines and lines[-1] != "":
            lines = lines[:-1]  # torn last line
        lines = [ln for ln in map(unseal, lines) if ln is not None]
        for line in _trusted(lines, boot_id()):
            parts = line.split(" ")
            try:
                if parts[0] == "c" and len(parts) == 4:
                    key = (int(parts[1]), int(parts[2]))
                    state.chunks[key] = max(state.chunks.get(key, 0), int(parts[3]))
                elif parts[0] == "F" and len(parts) == 4:
                    verified = tuple(a for a in parts[3].split(",") if a and a != "-")
                    state.files[int(parts[1])] = (parts[2], verified)
                elif parts[0] == "R" and len(parts) == 2:  # file reset (re-fetch after mismatch)
                    idx = int(parts[1])
                    state.files.pop(idx, None)
                    for key in [k for k in state.chunks if k[0] == idx]:
                        del state.chunks[key]
            except ValueError:
                continue
        return state

    def open(self, fresh: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0)
        self._fd = os.open(self.path, flags, 0o644)
        # A new boot line starts every run: lines after it are judged by this boot's id. The
        # leading newline ends a line torn by a crash, which would otherwise swallow the boot
        # line and let this run's marks cover the unsynced tail of the last boot's segment.
        self._write(f"\nboot {boot_id() or UNKNOWN_BOOT}\n")
        self._lines = 0

    def _write(self, line: str, file_idx: int | None = None) -> bool:
        with self._lock:
            if file_idx is not None and file_idx in self._lost:
                return False  # the file's data was lost at write-back: nothing of it counts any more
            self._append(line)
            return True

    def _append(self, line: str) -> None:
        """Append one line; the caller holds ``_lock``."""
        if self._fd < 0:
            return
        data = seal(line).encode()
        try:
            if os.write(self._fd, data) != len(data):  # a torn line would shift the marks' count
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            # Data files are preallocated, so on a disk that another writer fills up
            # mid-download the journal is what fails to grow: the store's one-line
            # space error, not a bare "[Errno 28]".
            os.close(self._fd)  # nothing more may be appended after a torn line
            self._fd = -1
            raise store_error(exc, self.path, "writing the resume journal") from exc
        self._lines += 1

    def chunk(self, file_idx: int, chunk_idx: int, done: int) -> None:
        if self._write(f"c {file_idx} {chunk_idx} {done}\n", file_idx) and self.listener is not None:
            self.listener.chunk(file_idx, chunk_idx, done)

    def file_done(self, file_idx: int, xxh3: str, verified: tuple[str, ...]) -> None:
        if self._write(f"F {file_idx} {xxh3} {','.join(verified) or '-'}\n", file_idx) and self.listener is not None:
            self.listener.file_done(file_idx)

    def file_reset(self, file_idx: int) -> None:
        """The file is fetched again from its first byte (a checksum mismatch)."""
        if self.listener is not None:  # first: nothing of the file may be served from here on
            self.listener.file_reset(file_idx)
        self._write(f"R {file_idx}\n")

    def file_lost(self, file_idx: int) -> None:
        """The file's write-back failed: none of its journaled pieces may be resumed.

        Within one boot unsynced lines are trusted (the page cache holds their data), so without
        this a resume would read back the zeros the failed write-back left and hash them as the
        file. Lines for the file that this run still writes are dropped too: a worker may journal
        a piece written before the error was seen. If even this line cannot be written (the
        disk is full), the whole journal is emptied and closed for this run: the next download
        starts over, which is safe.
        """
        if self.listener is not None:
            self.listener.file_reset(file_idx)
        with self._lock:
            if file_idx in self._lost:
                return
            self._lost.add(file_idx)
            if self._fd >= 0:
                try:
                    self._append(f"R {file_idx}\n")
                    return
                except ModelcacheError:
                    pass  # _append closed the journal: nothing more is written this run
            try:
                os.truncate(self.path, 0)
            except OSError as exc:
                log.error("cannot reset the resume journal %s after a lost write (%s): delete it before "
                          "pulling again", self.path, exc.strerror)

    def mark(self) -> int:
        """Take before fdatasyncing the data files; pass to ``synced`` once they are durable."""
        with self._lock:
            return self._lines

    def synced(self, upto: int | None = None) -> None:
        """The data of the first ``upto`` lines of this run (all so far if None) is on disk."""
        with self._lock:
            upto = self._lines if upto is None else upto
        self._write(f"S {upto}\n")

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
