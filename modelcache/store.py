"""The node store: staged downloads, atomic publish, manifests, locks, eviction.

Layout under one root (docs/architecture.md, "The node store")::

    <root>/models/<storageKey>/...                 the model, exactly as serving pods see it
    <root>/.modelcache/manifests/<storageKey>.json what was published, with per-file digests
    <root>/.modelcache/manifests/<storageKey>.pieces.json  piece hashes, for peers (modelcache.peers)
    <root>/.modelcache/manifests/<storageKey>.damaged.json the model is damaged: which files, why
    <root>/.modelcache/staging/<storageKey>/       data/ (in-flight files), plan.json, journal
    <root>/.modelcache/locks/<storageKey>.lock     flock: one writer per model per machine

A model is present only when its manifest exists, no publish of it is under way (a pending
manifest in its staging folder), it is not marked damaged, and the folder matches the manifest
(every file there with its size). A publish writes the pending manifest first, then swaps the
folder (or merges into it), then installs the manifest: a crash in any step leaves a model that
is not present until ``recover`` has either put back the old state or checked the new folder
against the pending manifest, never a manifest over other bytes. A folder the store knew (a
manifest, damaged or not, a damage mark, a repair) is never taken for one someone else filled
(``knew``, ``record``). The initializer uses the same code with ``DestLayout``: the model folder
is the destination itself and the bookkeeping lives in ``<dest>/.modelcache/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import stat
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from modelcache.clock import rfc3339
from modelcache.diskio import fsync_dir, store_error
from modelcache.errors import CancelledError, ModelInUseError, StoreError
from modelcache.integrity import hash_file
from modelcache.lockscope import check_exclusive
from modelcache.reserved import META_DIR

log = logging.getLogger(__name__)

#: 2: the manifest carries ``seal``, a digest of all its other fields (1, unsealed, is still read).
MANIFEST_VERSION = 2


@dataclass(frozen=True)
class ManifestFile:
    path: str
    size: int
    xxh3: str
    checksums: dict[str, str] = field(default_factory=dict)  # source checksums the bytes matched
    #: The source's version of the file when it was listed (ETag, generation, Last-Modified,
    #: commit): what a drift check compares when the source offers no checksum to compare.
    version: str | None = None


@dataclass(frozen=True)
class Manifest:
    storage_key: str
    uri: str  # redacted: no query strings or userinfo
    resolved_uri: str
    revision: str | None
    files: list[ManifestFile]
    created_at: str
    version: int = MANIFEST_VERSION
    #: Files kept on their size alone when a folder someone else filled was adopted and the source
    #: gives no checksum: nothing compared their bytes with the source's (``ls`` says "unverified").
    unverified: list[str] = field(default_factory=list)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        doc = asdict(self)
        for f in doc["files"]:
            if f.get("version") is None:
                f.pop("version", None)  # the manifests of sources without versions stay as they were
        if not doc["unverified"]:
            del doc["unverified"]  # (as are those of models verified whole)
        doc["seal"] = seal_of(doc)
        return json.dumps(doc, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, sealed: bool = True) -> Manifest:
        """Parse and check a manifest; anything malformed is a ValueError (the model then is not
        present): a damaged manifest is never trusted as one, and its paths never name anything
        outside the model folder. ``sealed=False`` reads a manifest whose seal does not match (the
        store's record of a folder it knew: its digests decide which files are kept, never sizes)."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("files"), list):
            raise ValueError("not a manifest")
        # Any damage to a sealed manifest (a flipped digit of a size or digest) is caught here;
        # a manifest of version 1 predates the seal and is only checked field by field.
        seal = data.pop("seal", None)
        if sealed and (seal is not None or data.get("version") != 1) and seal != seal_of(data):
            raise ValueError("manifest seal does not match its contents")
        files = [_manifest_file(f) for f in data.pop("files")]
        for name in ("storage_key", "uri", "resolved_uri", "created_at"):
            if not isinstance(data.get(name), str):
                raise ValueError(f"manifest field {name!r} is not a string")
        if not (data.get("revision") is None or isinstance(data["revision"], str)):
            raise ValueError("manifest field 'revision' is not a string")
        if data.get("version") not in (1, MANIFEST_VERSION):
            raise ValueError(f"manifest version {data.get('version')!r} is not 1 or {MANIFEST_VERSION}")
        if len({f.path for f in files}) != len(files):
            raise ValueError("manifest lists a path twice")
        unverified = data.pop("unverified", [])
        if not isinstance(unverified, list) or not all(isinstance(u, str) for u in unverified) \
                or not set(unverified) <= {f.path for f in files}:
            raise ValueError("manifest field 'unverified' is not a list of its files")
        return cls(files=files, unverified=unverified, **data)


_XXH3_HEX = re.compile(r"[0-9a-f]{32}")


def seal_of(doc: dict[str, object]) -> str:
    """A digest of a JSON document's fields but ``seal``: what a sealed record carries."""
    canonical = json.dumps({k: v for k, v in doc.items() if k != "seal"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _manifest_file(doc: object) -> ManifestFile:
    if not isinstance(doc, dict) or set(doc) - {"path", "size", "xxh3", "checksums", "version"}:
        raise ValueError("manifest file entry is not an object of path, size, xxh3, checksums, version")
    path, size, xxh3 = doc.get("path"), doc.get("size"), doc.get("xxh3")
    version = doc.get("version")
    if version is not None and not isinstance(version, str):
        raise ValueError(f"manifest version of {path!r} is not a string")
    checksums = doc.get("checksums", {})
    if not isinstance(path, str) or not path or "\x00" in path or "\\" in path:
        raise ValueError(f"manifest path {path!r} is not a file name")
    if path.startswith("/") or posixpath.normpath(path) != path or path == ".." or path.startswith("../"):
        raise ValueError(f"manifest path {path!r} is not a relative path inside the model")
    if type(size) is not int or size < 0:
        raise ValueError(f"manifest size {size!r} of {path!r} is not a byte count")
    if not isinstance(xxh3, str) or not _XXH3_HEX.fullmatch(xxh3):
        raise ValueError(f"manifest xxh3 of {path!r} is not a 128-bit hex digest")
    if not isinstance(checksums, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in checksums.items()):
        raise ValueError(f"manifest checksums of {path!r} are not names and values")
    return ManifestFile(path=path, size=size, xxh3=xxh3, checksums=checksums, version=version)


class TargetUnreachableError(StoreError):
    """gc: even evicting every model would not free ``target`` bytes."""

    reason = "TargetUnreachable"

    def __init__(self, target: int, free: int, reclaimable: int, models: int) -> None:
        from modelcache.progress import human_bytes

        self.target, self.free, self.reclaimable, self.models = target, free, reclaimable, models
        super().__init__(
            f"--target-free {human_bytes(target)} cannot be reached: {human_bytes(free)} is free and evicting "
            f"every model not in use ({models}, {human_bytes(reclaimable)}) would make it "
            f"{human_bytes(free + reclaimable)}; nothing was evicted. Lower --target-free, or add --evict-all "
            "to evict them all anyway"
        )


def _holder(fd: int) -> str:
    """" (pid N)" from a lock file its holder wrote its pid into, else ""."""
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (pid {text})" if text.isdigit() else ""


@dataclass(frozen=True)
class StoreEntry:
    storage_key: str
    uri: str
    size: int
    files: int
    created_at: str
    last_used: float
    present: bool
    #: Marked damaged (a check or a refused repair): not present until a pull or repair fixes it.
    damaged: bool = False
    #: Files kept on their size alone at adoption (the source gives no checksum).
    unverified: int = 0
    #: Made by this store (see ``NodeStore.made``); False: a folder someone else put there.
    made: bool = True

    @property
    def last_used_at(self) -> str:
        """``last_used`` as an RFC 3339 time, as every other time modelcache shows."""
        return rfc3339(self.last_used) if self.last_used else ""


@dataclass(frozen=True)
class VerifyProblem:
    path: str
    problem: str


@dataclass(frozen=True)
class Damage:
    """What the store knows of a damaged model (``NodeStore.mark_damaged``)."""

    #: Files found damaged (empty: not known which, e.g. a size check saw one differ).
    files: tuple[str, ...]
    reason: str
    since: str


#: The steps of a publish, in order. ``_step`` is called at each; crash tests kill the process
#: exactly there (tests/crashpoints.py), so every window is tested, not only random moments.
PUBLISH_STEPS = ("pending", "merging", "swapped", "cleared", "installed")
#: The steps of an in-place repair's install (``install_in_place``), likewise.
REPAIR_STEPS = ("repair-renamed", "repair-installed")


def _step(name: str) -> None:
    """A publish reached step ``name`` (``PUBLISH_STEPS``, ``REPAIR_STEPS``). Nothing to do: a seam for crash tests."""


class Layout(ABC):
    """Where one model's folder, manifest, staging area and lock live."""

    #: The store's bookkeeping folder (``META_DIR``): only this module builds paths in it.
    meta: Path

    @abstractmethod
    def model_dir(self, key: str) -> Path: ...

    @abstractmethod
    def manifest_path(self, key: str) -> Path: ...

    @abstractmethod
    def staging_dir(self, key: str) -> Path: ...

    @abstractmethod
    def lock_path(self, key: str) -> Path: ...

    @abstractmethod
    def pieces_path(self, key: str) -> Path:
        """The published model's piece hashes (``modelcache.peers.pieces.PieceRecord``)."""

    def damaged_path(self, key: str) -> Path:
        """The model is damaged (``Damage``): not present, whatever the sizes say, until a pull or a
        repair has put right the files it names."""
        return self.manifest_path(key).with_name(f"{key}.damaged.json")

    def pending_path(self, key: str) -> Path:
        """The manifest of a publish under way: from its writing until the manifest is installed
        the model is not present, and after a crash ``recover`` decides what it describes."""
        return self.staging_dir(key) / "manifest.json"

    @property
    @abstractmethod
    def base(self) -> Path:
        """The folder the store lives in (named in errors about the store as a whole)."""


class NodeLayout(Layout):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.meta = self.root / META_DIR

    @property
    def base(self) -> Path:
        return self.root

    def model_dir(self, key: str) -> Path:
        return self.root / "models" / key

    def manifest_path(self, key: str) -> Path:
        return self.meta / "manifests" / f"{key}.json"

    @property
    def staging_root(self) -> Path:
        """Where every staged download of the store lives (one folder per storage key)."""
        return self.meta / "staging"

    def staging_dir(self, key: str) -> Path:
        return self.staging_root / key

    def lock_path(self, key: str) -> Path:
        return self.meta / "locks" / f"{key}.lock"

    def pieces_path(self, key: str) -> Path:
        return self.meta / "manifests" / f"{key}.pieces.json"
    def repair_dir(self, key: str) -> Path:
        """Where an in-place repair downloads the damaged files (same file system, resumable)."""
        return self.meta / "repair" / key

    def pin_path(self, key: str) -> Path:
        """The damaged model's manifest, kept until its repair is installed: what it restores."""
        return self.meta / "repair" / f"{key}.pinned.json"

    def unlisted_dir(self, key: str) -> Path:
        """Where adoption moves what a model folder held beyond the model (kept, never deleted)."""
        return self.meta / "unlisted" / key

    def root_lock_path(self) -> Path:
        """Held by the one agent that manages this root."""
        return self.meta / "agent.lock"

    def agent_root_path(self) -> Path:
        """Written when an agent takes the root: from then on it owns every model in it."""
        return self.meta / "agent-root"


class DestLayout(Layout):
    """Models written straight into a destination folder (the init container's /mnt/models).

    Usually one; SRC DEST pairs that share a DEST put several into it (one after another, never
    at once), so each keeps its own manifest: with one file the last pair's would replace the
    others' and every run would download them all again."""

    def __init__(self, dest: Path) -> None:
        self.dest = Path(dest)
        self.meta = self.dest / META_DIR

    @property
    def base(self) -> Path:
        return self.dest

    def model_dir(self, key: str) -> Path:
        return self.dest

    def manifest_path(self, key: str) -> Path:
        return self.meta / "manifests" / f"{key}.json"

    @property
    def staging_root(self) -> Path:
        return self.meta / "staging"

    def staging_dir(self, key: str) -> Path:
        return self.staging_root

    def lock_path(self, key: str) -> Path:
        return self.meta / "lock"

    def pieces_path(self, key: str) -> Path:
        return self.meta / "pieces.json"


#: A download's piece record (peers), left in its staging folder for ``publish`` to install.
_STAGED_PIECES = "pieces.json"


def stage_piece_record(staging: Path, text: str) -> None:
    """Leave a download's piece record in its staging folder (durable, renamed into place):
    ``publish`` installs it next to the manifest, in the same step as the model."""
    path = staging / _STAGED_PIECES
    try:
        _write_whole(path, text)
    except OSError as exc:
        raise store_error(exc, str(path), "writing the piece record") from exc


def first_stop(base: Path, rel: str) -> tuple[Path, os.stat_result] | None:
    """Walk ``rel`` down from ``base`` without following a link: the first entry on the way that
    is a link or not a folder, else the last one, with its ``lstat``; None where one is missing."""
    path = base
    parts = PurePosixPath(rel).parts
    for n, part in enumerate(parts):
        path = path / part
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or n == len(parts) - 1:
            return path, st
    return None


def regular_file_inside(base: Path, rel: str) -> os.stat_result | None:
    """``base/rel`` as a regular file reached without following a symlink at any component
    (``rel``'s folders included: a linked sub-folder would put the model outside the store), else None."""
    hit = first_stop(base, rel)
    if hit is None or hit[0] != base.joinpath(*PurePosixPath(rel).parts) or not stat.S_ISREG(hit[1].st_mode):
        return None
    return hit[1]


def _write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` durably and whole: a reader (or a crash) sees it all or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_dir(str(path.parent))


def file_matches(path: Path, want: ManifestFile) -> bool:
    """The file at ``path`` is ``want``: a regular file (no link) of its size and xxh3."""
    try:
        st = path.lstat()
    except OSError:
        return False
    if not os.path.isfile(path) or os.path.islink(path) or st.st_size != want.size:
        return False
    return hash_file(path, size=st.st_size).local_hexdigest() == want.xxh3


def _discard(path: Path) -> None:
    """Delete a folder moved to the trash; a link moved there goes as a link, never what it names."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


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


#: ``guard(key, folder)``: raise to refuse replacing or deleting a model folder (the CLI's check
#: that no pod on the node mounts it, modelcache.mountusers; the agent asks the API instead).
Guard = Callable[[str, Path], None]


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


class NodeStore:
    def __init__(self, layout: Layout, guard: Guard | None = None) -> None:
        self.layout = layout
        self.guard = guard

    @classmethod
    def at(cls, root: str | os.PathLike[str], guard: Guard | None = None) -> NodeStore:
        return cls(NodeLayout(Path(root)), guard)

    def check_replaceable(self, key: str) -> None:
        """Before a model folder that exists is replaced or deleted: the guard may refuse."""
        folder = self.layout.model_dir(key)
        if self.guard is not None and folder.exists():
            self.guard(key, folder)

    # ---- locking ----------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, key: str, blocking: bool = True, cancel: threading.Event | None = None,
             on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """Exclusive per-model lock across processes: two pulls of one model download once.

        A blocking wait with ``cancel`` polls instead of sleeping in ``flock``, so setting it ends
        the wait (CancelledError): a process told to stop is never stuck behind another's pull.
        The holder writes its pid into the lock file, so a process that must wait (``on_wait``
        is told whom it waits for) and ``modelcache ls`` can say which process has the model.
        """
        path = self.layout.lock_path(key)
        check_exclusive(self.layout.base)  # flock that other hosts ignore would exclude nothing
        told = False
        while True:
            fd, writable = self._open_lock(path)
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
            if writable and isinstance(self.layout, NodeLayout) and not self.has(key):
                # Nothing of the model is left (removed, evicted, a pull refused before it staged
                # a byte): its lock file goes too, unlinked while held (every locker checks that
                # the file it locked is still the one at the path), so locks do not pile up.
                with contextlib.suppress(OSError):
                    path.unlink()
            os.close(fd)

    @staticmethod
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

    def busy(self, key: str) -> bool:
        """Another process holds the model's lock right now (a pull in flight). Creates nothing."""
        try:
            fd = os.open(self.layout.lock_path(key), os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    # ---- reading ----------------------------------------------------------------------

    def manifest(self, key: str) -> Manifest | None:
        try:
            m = Manifest.from_json(self.layout.manifest_path(key).read_text())
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return m if m.storage_key == key else None

    def is_present(self, key: str) -> bool:
        """Manifest there, no publish under way, not marked damaged, and every listed file there
        with its size (cheap: stats only)."""
        m = self.manifest(key)
        if m is None or self.layout.pending_path(key).exists() or self.layout.damaged_path(key).exists():
            return False
        base = self.layout.model_dir(key)
        for f in m.files:
            try:
                if (base / f.path).stat().st_size != f.size:
                    return False
            except OSError:
                return False
        return True

    def published(self, key: str) -> bool:
        """The model's manifest is installed, not marked damaged and no publish of it is under
        way (three stats: no manifest is read, no file of the model looked at)."""
        return (self.layout.manifest_path(key).exists() and not self.layout.damaged_path(key).exists()
                and not self.layout.pending_path(key).exists())

    def damage(self, key: str) -> Damage | None:
        """The model's damage mark, if it has one (an unreadable mark still marks it damaged)."""
        try:
            text = self.layout.damaged_path(key).read_text()
        except FileNotFoundError:
            return None
        except OSError:
            return Damage((), "damage mark unreadable", "")
        try:
            doc = json.loads(text)
            return Damage(tuple(str(f) for f in doc["files"]), str(doc["reason"]), str(doc["since"]))
        except (ValueError, KeyError, TypeError):
            return Damage((), "damage mark unreadable", "")

    def knew(self, key: str) -> bool:
        """The store has a record of this model's folder: a manifest (readable or not), a damage
        mark, a repair's pin or download. Such a folder is ours: a pull checks it against
        ``record``, never adopts it as a folder someone else filled (``modelcache.adopt``)."""
        paths = [self.layout.manifest_path(key), self.layout.damaged_path(key)]
        if isinstance(self.layout, NodeLayout):
            paths += [self.layout.pin_path(key), self.layout.repair_dir(key)]
        return any(os.path.lexists(p) for p in paths)

    def record(self, key: str, sealed: bool = False) -> Manifest | None:
        """What the store last recorded of the model's folder, to check the files against: a
        repair's pin (kept by an older version), else the manifest, read even if its seal broke
        (a damaged record can only make a file fail its digest and be fetched again) unless
        ``sealed``."""
        paths = [self.layout.manifest_path(key)]
        if isinstance(self.layout, NodeLayout):
            paths.insert(0, self.layout.pin_path(key))
        for path in paths:
            try:
                m = Manifest.from_json(path.read_text(), sealed=sealed)
            except (OSError, ValueError, TypeError, KeyError):
                continue
            if m.storage_key == key:
                return m
        return None

    def pieces_text(self, key: str) -> str | None:
        """The piece record published with the model, as stored (the peers module parses it)."""
        try:
            return self.layout.pieces_path(key).read_text()
        except OSError:
            return None

    def touch(self, key: str) -> None:
        """Record a use, for least-recently-used eviction."""
        with contextlib.suppress(OSError):
            os.utime(self.layout.manifest_path(key))

    def keys(self) -> list[str]:
        if not isinstance(self.layout, NodeLayout):
            raise StoreError("listing needs a node store root")
        found: set[str] = set()
        mdir = self.layout.meta / "manifests"
        if mdir.is_dir():
            found |= {p.stem for p in mdir.glob("*.json") if "." not in p.stem}  # not <key>.pieces.json
        models = self.layout.root / "models"
        if models.is_dir():  # a dot folder is never a model (a trash folder left by a crash)
            found |= {p.name for p in models.iterdir() if p.is_dir() and not p.name.startswith(".")}
        return sorted(found)

    def has(self, key: str) -> bool:
        """Anything of the model in the store: manifest, folder, staged download, repair in
        progress. Creates nothing."""
        return any(p.exists() for p in self._paths_of(key))

    def _paths_of(self, key: str) -> list[Path]:
        layout = self.layout
        paths = [layout.manifest_path(key), layout.model_dir(key), layout.staging_dir(key), layout.damaged_path(key)]
        if isinstance(layout, NodeLayout):
            paths += [layout.repair_dir(key), layout.pin_path(key), layout.unlisted_dir(key)]
        return paths

    def disk_keys(self) -> set[str]:
        """Every storage key this store made something of under the root: published, staged
        (a download, or a publish a crash interrupted), or under repair (its folder or its pin).
        A folder under ``models/`` that none of these records is not ours (``foreign``)."""
        if not isinstance(self.layout, NodeLayout):
            raise StoreError("listing needs a node store root")
        keys = {k for k in self.keys() if self.made(k)}
        for folder in (self.layout.meta / "staging", self.layout.meta / "repair"):
            if folder.is_dir():
                keys |= {p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}
        suffix = self.layout.pin_path("").name  # a repair's pin outlives a crash: its model is on disk too
        repair = self.layout.meta / "repair"
        if repair.is_dir():
            keys |= {p.name.removesuffix(suffix) for p in repair.glob("*" + suffix)}
        return keys

    def made(self, key: str) -> bool:
        """Whether this store made the model (or is making it): its manifest, a repair's pin or
        download, a staged download or publish, or a folder claimed for a download container.
        A folder under ``models/`` without any of these was put there by someone else (KServe's
        node agent, a user's copy): gc and the agent never delete it; only ``rm`` of its name."""
        layout = self.layout
        paths = [layout.manifest_path(key), layout.staging_dir(key), layout.damaged_path(key)]
        if isinstance(layout, NodeLayout):
            paths += [layout.repair_dir(key), layout.pin_path(key), layout.unlisted_dir(key)]
        return any(p.exists() for p in paths)

    def agent_owned(self) -> bool:
        """An agent took this root before (its mark, or the root lock an earlier agent left)."""
        layout = self._node()
        return layout.agent_root_path().exists() or layout.root_lock_path().exists()

    def mark_agent_owned(self, by: str) -> None:
        """The agent takes the root: it deletes every model its spec does not list from now on."""
        path = self._node().agent_root_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"by": by, "at": rfc3339()}) + "\n")
        except OSError as exc:
            raise store_error(exc, str(path), "marking the root as the agent's") from exc

    def foreign(self) -> list[str]:
        """The folders under ``models/`` that this store did not make (see ``made``)."""
        return [k for k in self.keys() if not self.made(k)]

    def claim(self, key: str) -> None:
        """Record that the model folder is being filled for this store by someone else's code
        (a download container): until its manifest is installed, the folder counts as ours."""
        staging = self.layout.staging_dir(key)
        try:
            staging.mkdir(parents=True, exist_ok=True)
            (staging / "claimed").touch()
        except OSError as exc:
            raise store_error(exc, str(staging), "claiming the model folder") from exc

    # ---- a pull that failed ------------------------------------------------------------
    # A failed pull keeps what it staged (the next pull of the URI resumes from it) and says why
    # it failed, so ``ls`` does not call it "interrupted"; one that failed before it staged a
    # byte (no space, a refused listing) leaves nothing behind.

    def record_failure(self, key: str, reason: str, message: str) -> None:
        """Keep why the staged download of ``key`` failed (until the next pull of it starts)."""
        path = self.layout.staging_dir(key) / "failed.json"
        if not path.parent.is_dir():
            return
        with contextlib.suppress(OSError):
            path.write_text(json.dumps({"reason": reason, "message": message, "at": rfc3339()}))

    def failure(self, key: str) -> str | None:
        """Why the staged download of ``key`` failed (``reason: message``), or None."""
        try:
            doc = json.loads((self.layout.staging_dir(key) / "failed.json").read_text())
            return f"{doc['reason']}: {doc['message']}"
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def clear_failure(self, key: str) -> None:
        (self.layout.staging_dir(key) / "failed.json").unlink(missing_ok=True)

    def drop_staging(self, key: str) -> None:
        """Remove a staged download that holds nothing worth resuming (caller holds the lock)."""
        if isinstance(self.layout, NodeLayout):
            shutil.rmtree(self.layout.staging_dir(key), ignore_errors=True)

    def disk_usage(self, key: str) -> int:
        """Bytes the files in the model folder take (their sizes; links not followed)."""
        total = 0
        for dirpath, _dirs, files in os.walk(self.layout.model_dir(key)):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_size
        return total

    def unlisted_dir(self, key: str) -> Path:
        """Where files an adopted folder held beyond its model were moved (node stores only)."""
        return self.layout.unlisted_dir(key) if isinstance(self.layout, NodeLayout) else self.layout.meta / "unlisted"

    def set_aside_unlisted(self, key: str, keep: Collection[str]) -> list[str]:
        """Move every file and link of the model folder that is not in ``keep`` (what the model is)
        out of it, into ``unlisted_dir`` (caller holds the lock): pods must see the model and only
        the model, and what someone else left there is kept, not deleted. A linked sub-folder
        goes whole (as the link). A destination folder is left alone: pairs that share it each
        list only their own files."""
        if not isinstance(self.layout, NodeLayout):
            return []
        folder = self.layout.model_dir(key)
        found: list[str] = []

        def walk(d: Path, prefix: str) -> None:
            with os.scandir(d) as it:
                for entry in sorted(it, key=lambda e: e.name):
                    rel = prefix + entry.name
                    if entry.is_dir(follow_symlinks=False):
                        walk(Path(entry.path), rel + "/")
                    elif rel not in keep:
                        found.append(rel)

        walk(folder, "")
        if not found:
            return []
        dest = self.layout.unlisted_dir(key) / rfc3339().replace(":", "")
        try:
            for rel in found:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                os.rename(folder / rel, dest / rel)
            parents = {(folder / rel).parent for rel in found}
            for d in sorted(parents, key=lambda p: len(p.parts), reverse=True):  # deepest first
                while d != folder:
                    try:
                        d.rmdir()  # left empty by the moves: it goes too (a folder with anything in it stays)
                    except OSError:
                        break
                    d = d.parent
            for d in sorted({folder, *(p for p in parents if p.exists())}):
                fsync_dir(str(d))
        except OSError as exc:
            raise store_error(exc, str(folder), "moving unlisted files out of the model folder") from exc
        log.warning("files the source does not list moved out of the model folder", extra={"fields": {
            "storage_key": key, "to": str(dest), "files": ",".join(found[:20]), "count": len(found)}})
        return found

    def foreign_names(self, key: str) -> list[str]:
        """What the model folder holds besides the store's own bookkeeping (a DEST keeps it inside)."""
        folder = self.layout.model_dir(key)
        return [n for n in os.listdir(folder) if not (isinstance(self.layout, DestLayout) and n == META_DIR)]

    def entries(self) -> list[StoreEntry]:
        """Every folder under ``models/`` and every manifest. A model without its manifest (one
        under repair, a folder not made here) shows the bytes its folder really holds."""
        out = []
        for key in self.keys():
            m = self.manifest(key)
            try:
                used = self.layout.manifest_path(key).stat().st_mtime
            except OSError:
                used = 0.0
            present = self.is_present(key)
            pinned = self.pinned_manifest(key) if m is None and isinstance(self.layout, NodeLayout) else None
            known = m or pinned
            out.append(
                StoreEntry(
                    storage_key=key,
                    uri=known.uri if known else "",
                    size=m.total_size if m and present else self.disk_usage(key),
                    files=len(known.files) if known else sum(1 for p in self.layout.model_dir(key).rglob("*")
                                                              if p.is_file()),
                    created_at=known.created_at if known else "",
                    last_used=used,
                    present=present,
                    made=self.made(key),
                    damaged=self.layout.damaged_path(key).exists(),
                    unverified=len(m.unverified) if m else 0,
                )
            )
        return out

    # ---- writing ----------------------------------------------------------------------

    def recover(self, key: str) -> None:
        """Finish or undo a publish that a crash interrupted (caller holds the lock).

        Where the folder was not touched yet (the staged data is still there), the pending
        manifest goes: the old manifest, if any, describes the folder again, and the staged data
        stays for a resume. An in-place merge that had started is finished (every staged file was
        complete before the publish began). Once the folder is the new one, the pending manifest
        is installed; if the folder does not hash to it (damage since, or a stale pending manifest
        from before an in-place repair), it is installed marked damaged with the files that
        differ: never present, and the next pull or repair fetches exactly those again.
        """
        self._restore_legacy_pin(key)
        staging = self.layout.staging_dir(key)
        pending = self.layout.pending_path(key)
        if isinstance(self.layout, NodeLayout):
            for trash in staging.parent.glob(f".trash-{key}-*"):  # a replaced folder not deleted yet
                _discard(trash)
        if not pending.exists():
            if (isinstance(self.layout, NodeLayout) and staging.is_dir() and not (staging / "data").exists()
                    and not (staging / "extract").exists() and self.layout.manifest_path(key).exists()):
                shutil.rmtree(staging, ignore_errors=True)  # a publish done but for its clean-up
            return
        try:
            manifest: Manifest | None = Manifest.from_json(pending.read_text())
        except (OSError, ValueError, TypeError, KeyError):
            manifest = None
        if manifest is not None and manifest.storage_key != key:
            return  # another model's publish (pairs that share a DEST share its staging folder)
        data = staging / "data"
        target = self.layout.model_dir(key)
        try:
            if manifest is not None and (staging / "merging").exists() and data.exists():
                self._merge_into(data, target)
                shutil.rmtree(data)
            if manifest is None or data.exists() or not target.is_dir():
                pending.unlink()  # the folder is as it was before this publish
                (staging / "merging").unlink(missing_ok=True)
                fsync_dir(str(staging))
                return
            problems = self._problems(key, manifest)
            self._forget_repair(key)  # the folder they described was replaced
            if problems:
                log.warning("an interrupted publish left files that do not match its manifest; marked damaged",
                            extra={"fields": {"storage_key": key, "files": ",".join(p.path for p in problems[:20])}})
                self.mark_damaged(key, [p.path for p in problems], "after an interrupted publish: "
                                  + "; ".join(f"{p.path}: {p.problem}" for p in problems[:3]))
            self._install_manifest(key, pending)
        except OSError as exc:
            raise store_error(exc, str(target), "recovering an interrupted publish") from exc
        shutil.rmtree(staging, ignore_errors=True)

    def publish(self, key: str, manifest: Manifest, in_place: bool = False) -> Path:
        """Move ``staging/data`` into place and install the manifest. Caller holds the lock.

        ``in_place``: the model folder exists and holds the rest of the model (adoption): each
        staged file is renamed into it, the folder itself stays (a pod may mount it).

        The steps (``PUBLISH_STEPS``): the pending manifest is written (from then on the model is
        not present); an in-place merge is marked as started; the folder is swapped (one rename)
        or merged into; the damage mark and repair records of the replaced folder go; the piece
        record (``pieces.json``, left in staging by a download that peers took part in, else the
        older one goes: it would describe other bytes) and the manifest are installed. A crash
        between any two is finished or undone by ``recover``.
        """
        staging = self.layout.staging_dir(key)
        data = staging / "data"
        target = self.layout.model_dir(key)
        pending = self.layout.pending_path(key)
        trash: Path | None = None
        try:
            _write_whole(pending, manifest.to_json())
            _step("pending")
            if isinstance(self.layout, DestLayout) or in_place:
                (staging / "merging").touch()
                fsync_dir(str(staging))
                _step("merging")
                self._merge_into(data, target)
                # Only emptied folders are left; gone, they tell ``recover`` that the files are in
                # place if we die before the manifest is.
                shutil.rmtree(data)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.exists() or target.is_symlink():  # an unlisted or damaged copy: replace it whole
                    self.check_replaceable(key)  # (again: a pod may have mounted it meanwhile)
                    trash = staging.parent / f".trash-{key}-{time.time_ns()}"
                    os.rename(target, trash)
                os.rename(data, target)
                fsync_dir(str(target.parent))
            _step("swapped")
            self._forget_repair(key)
            _step("cleared")
            pieces = staging / _STAGED_PIECES
            if pieces.exists():
                self.layout.pieces_path(key).parent.mkdir(parents=True, exist_ok=True)
                os.replace(pieces, self.layout.pieces_path(key))
            else:
                self.layout.pieces_path(key).unlink(missing_ok=True)
            self._install_manifest(key, pending)
            _step("installed")
        except OSError as exc:
            raise store_error(exc, str(target), "publishing") from exc
        if trash is not None:  # deleted once the new folder is in place (a big model takes a while)
            _discard(trash)
        shutil.rmtree(staging, ignore_errors=True)
        return target

    def install_manifest(self, key: str, manifest: Manifest) -> None:
        """Write ``manifest`` for a folder already in place (caller holds the lock): durable, then
        renamed into place, so a reader sees no manifest or the whole one. It describes the
        folder as it is: any damage mark or repair record of an earlier one goes."""
        pending = self.layout.pending_path(key)
        try:
            _write_whole(pending, manifest.to_json())
            self.layout.pieces_path(key).unlink(missing_ok=True)  # an older record would describe other bytes
            self._forget_repair(key)
            self._install_manifest(key, pending)
        except OSError as exc:
            raise store_error(exc, str(pending), "writing the manifest") from exc
        shutil.rmtree(self.layout.staging_dir(key), ignore_errors=True)

    def _install_manifest(self, key: str, pending: Path) -> None:
        final = self.layout.manifest_path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(pending, final)
        fsync_dir(str(final.parent))

    # ---- damage ------------------------------------------------------------------------

    def mark_damaged(self, key: str, files: Iterable[str] = (), reason: str = "") -> None:
        """Mark the model damaged (``Damage``): it stops being present for every reader, its
        manifest stays as the record of what it was (what a repair restores, what a pull checks
        the folder against). Files already marked stay marked."""
        old = self.damage(key)
        names = sorted({*(old.files if old else ()), *files})
        doc = {"files": names, "reason": reason or (old.reason if old else "damaged"),
               "since": old.since if old and old.since else rfc3339()}
        try:
            _write_whole(self.layout.damaged_path(key), json.dumps(doc, indent=1))
        except OSError as exc:
            raise store_error(exc, str(self.layout.damaged_path(key)), "marking the model damaged") from exc

    def _forget_repair(self, key: str) -> None:
        """The folder they described is gone or fixed: its damage mark and repair records go too."""
        self.layout.damaged_path(key).unlink(missing_ok=True)
        if isinstance(self.layout, NodeLayout):
            self.layout.pin_path(key).unlink(missing_ok=True)
            shutil.rmtree(self.layout.repair_dir(key), ignore_errors=True)

    def _restore_legacy_pin(self, key: str) -> None:
        """An older version took a damaged model's manifest away as the repair's pin; today the
        manifest stays, marked damaged. A pin left without a manifest goes back (caller holds the lock)."""
        if not isinstance(self.layout, NodeLayout):
            return
        pin = self.layout.pin_path(key)
        final = self.layout.manifest_path(key)
        if pin.exists() and not final.exists():
            self.mark_damaged(key, (), "a repair was under way")
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(pin, final)
            fsync_dir(str(final.parent))
        elif pin.exists():
            pin.unlink()

    @staticmethod
    def _merge_into(data: Path, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        for entry in sorted(data.iterdir()):
            dst = target / entry.name
            if dst.is_dir() and not dst.is_symlink() and entry.is_dir():
                NodeStore._merge_into(entry, dst)
                continue
            if dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst)
            elif dst.exists() or dst.is_symlink():
                dst.unlink()
            os.rename(entry, dst)
        fsync_dir(str(target))

    def remove(self, key: str) -> bool:
        """Delete a model: its folder first (out of ``models/`` in one rename, so it stops being
        present), then its manifest and the rest. A crash in between leaves a manifest without
        a folder, never a folder of ours that looks like someone else's (``made``)."""
        removed = False
        with self.lock(key, blocking=False):
            self.check_replaceable(key)  # before anything changes: refused, the model stays whole
            target = self.layout.model_dir(key)
            trash = None
            if os.path.lexists(target):
                trash = self._trash_dir(target) / f".trash-{key}-{time.time_ns()}"
                os.rename(target, trash)
                removed = True
            mpath = self.layout.manifest_path(key)
            if mpath.exists():
                mpath.unlink()
                removed = True
            self.layout.pieces_path(key).unlink(missing_ok=True)
            if trash is not None:
                _discard(trash)
            staging = self.layout.staging_dir(key)
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
                removed = True
            if isinstance(self.layout, NodeLayout) and self.layout.unlisted_dir(key).exists():
                shutil.rmtree(self.layout.unlisted_dir(key), ignore_errors=True)  # removed by name: with it
                removed = True
            # An unfinished repair and the damage mark go with their model.
            if self.layout.damaged_path(key).exists() or (isinstance(self.layout, NodeLayout) and (
                    self.layout.repair_dir(key).exists() or self.layout.pin_path(key).exists())):
                removed = True
            self._forget_repair(key)
        return removed

    # ---- in-place repair ---------------------------------------------------------------
    # A damaged model is fixed inside its folder (pods keep reading it): it is marked damaged
    # (not present for any reader; its manifest stays as the pin, what the repair restores), the
    # damaged files are downloaded into ``repair/<key>`` and renamed in, then the manifest is
    # written again and the mark goes. Every step here survives a crash: the mark and the repair
    # folder say what is left to do (modelcache.repair). A repair that is refused (the source
    # moved on) leaves the model marked damaged, its manifest in place and no download behind.

    def _node(self) -> NodeLayout:
        if not isinstance(self.layout, NodeLayout):
            raise StoreError("a repair needs a node store root")
        return self.layout

    def pin_damaged(self, key: str, files: Iterable[str] = (), reason: str = "") -> Manifest | None:
        """Mark a damaged model (it stops being present for every reader of the store) and return
        its manifest, kept as the repair's pin. The caller holds the model's lock."""
        self._node()
        self.mark_damaged(key, files, reason)
        return self.record(key)

    def pinned_manifest(self, key: str) -> Manifest | None:
        """The manifest a repair restores: the sealed record of a model that is not present
        (damaged, or its files no longer match), or None. One whose seal broke may name a wrong
        digest, which would refuse every repair: without a pin the repair fetches the model whole
        into its download and renames in only the files that differ."""
        return None if self.is_present(key) else self.record(key, sealed=True)

    def repair_download(self, key: str) -> Path:
        """The folder a repair downloads into (a destination of its own, resumable)."""
        folder = self._node().repair_dir(key)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def downloaded_manifest(self, folder: Path, key: str) -> Manifest | None:
        """The manifest a pull into ``folder`` (a repair download) left there."""
        return NodeStore(DestLayout(folder)).manifest(key)

    def repair_underway(self, key: str) -> bool:
        """A repair download was started (a crash may have interrupted it)."""
        return self._node().repair_dir(key).exists()

    def drop_repair_download(self, key: str) -> None:
        shutil.rmtree(self._node().repair_dir(key), ignore_errors=True)

    def install_in_place(self, key: str, staged: Path, manifest: Manifest, old_files: Iterable[str] = (),
                         only: Collection[str] | None = None) -> tuple[list[str], list[str]]:
        """Rename the staged files that differ into the model folder; return (replaced, removed).
        ``only``: the files that were fetched (the others were found whole and stay untouched).

        The caller holds the model's lock. The manifest is installed last: until then the model
        is not present, and a crash part-way leaves a folder that the next repair finishes.
        """
        target = self.layout.model_dir(key)
        target.mkdir(parents=True, exist_ok=True)
        replaced: list[str] = []
        touched_dirs: set[Path] = set()
        for f in manifest.files:
            if only is not None and f.path not in only:
                continue
            dst = target / f.path
            if file_matches(dst, f):
                continue
            src = staged / f.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst)  # a folder where a file belongs: never a rename target
            os.replace(src, dst)
            replaced.append(f.path)
            touched_dirs.add(dst.parent)
        wanted = {f.path for f in manifest.files}
        removed: list[str] = []
        for rel in sorted(set(old_files) - wanted):  # only files we published before: never a stranger's
            with contextlib.suppress(FileNotFoundError):
                (target / rel).unlink()
                removed.append(rel)
                touched_dirs.add((target / rel).parent)
        for d in sorted(touched_dirs):
            with contextlib.suppress(OSError):
                fsync_dir(str(d))
        _step("repair-renamed")
        # A publish that crashed before its manifest left one pending in staging: it describes the
        # folder as it was then, not as repaired, and ``recover`` must never find it later.
        shutil.rmtree(self.layout.staging_dir(key), ignore_errors=True)
        # Still marked damaged while the manifest is written: a crash in between repairs again
        # (every file matches by then: only the manifest and the mark are left to do).
        _write_whole(self.layout.manifest_path(key), manifest.to_json())
        _step("repair-installed")
        self._forget_repair(key)
        return replaced, removed

    def end_repair(self, key: str) -> None:
        """The repair is installed (or abandoned with its model): its mark, pin and download go."""
        self._node()
        self._forget_repair(key)

    # ---- records of other parts (the initializer's) ----------------------------------------

    def write_record(self, kind: str, key: str, text: str) -> None:
        """Keep ``text`` as the ``kind`` record of a model (``<meta>/<kind>/<key>.json``):
        written whole, fsynced and renamed into place, so a reader finds the old one or this."""
        path = self.layout.meta / kind / f"{key}.json"
        try:
            _write_whole(path, text)
        except OSError as exc:
            raise store_error(exc, str(path), f"writing the {kind} record") from exc

    def read_record(self, kind: str, key: str) -> str | None:
        try:
            return (self.layout.meta / kind / f"{key}.json").read_text()
        except OSError:
            return None

    def clear_bookkeeping(self) -> None:
        """Remove the store's folder from a DEST whose pair is done: runtimes that take every
        sub-directory for a model (Triton) must not find it."""
        if not isinstance(self.layout, DestLayout):
            raise StoreError("only a destination store is finished by removing its bookkeeping")
        shutil.rmtree(self.layout.meta, ignore_errors=True)

    def _trash_dir(self, target: Path) -> Path:
        """Where a folder goes to be deleted: out of ``models/``, which serving pods and ``ls``
        read (the rename is instant, the delete is not)."""
        if isinstance(self.layout, NodeLayout):
            d = self.layout.meta / "staging"
            d.mkdir(parents=True, exist_ok=True)
            return d
        return target.parent

    def clear_trash(self) -> None:
        """Delete trash folders a crash left between a rename and its delete."""
        assert isinstance(self.layout, NodeLayout)
        for folder in (self.layout.meta / "staging", self.layout.root / "models"):
            if folder.is_dir():
                for p in folder.glob(".trash-*"):
                    _discard(p)

    def gc(self, target_free: int, dry_run: bool = False, keep: frozenset[str] = frozenset(),
           stale_staging_after: float = 24 * 3600, evict_all: bool = False) -> list[StoreEntry]:
        """Evict least recently used models until ``target_free`` bytes are free.

        Staged downloads nobody has touched for ``stale_staging_after`` seconds (abandoned: the
        URI was never pulled again) are deleted first; a running pull holds its model's lock
        and is never touched. A target that evicting every model would still not reach raises
        ``TargetUnreachableError`` and evicts nothing, unless ``evict_all``: emptying a node
        for nothing is never what a typo in the target meant.
        """
        if not isinstance(self.layout, NodeLayout):
            raise StoreError("gc needs a node store root")
        ours = [e for e in self.entries() if e.made]  # a folder we did not make is never evicted
        if not evict_all:
            free = self.free_bytes()
            candidates = self.evictable(keep)
            reclaimable = sum(e.size for e in candidates)
            if free < target_free and free + reclaimable < target_free:
                raise TargetUnreachableError(target_free, free, reclaimable, len(candidates))
        if not dry_run:
            self.clear_trash()
            self._clear_stale_staging(stale_staging_after)
        free = self.free_bytes()
        evicted: list[StoreEntry] = []
        for entry in sorted(ours, key=lambda e: e.last_used):
            if free >= target_free:
                break
            if entry.storage_key in keep:
                continue
            try:
                if dry_run:
                    self.check_replaceable(entry.storage_key)
                else:
                    self.remove(entry.storage_key)
            except ModelInUseError:
                continue  # a running pull, or a pod that mounts it
            except StoreError:
                if not dry_run:
                    raise  # it cannot be told whether a pod mounts it: the guard's message says why
            evicted.append(entry)
            free += entry.size
        return evicted

    def evictable(self, keep: Collection[str] = frozenset()) -> list[StoreEntry]:
        """The models gc may evict: made here, not in ``keep``, not in use right now."""
        return [e for e in self.entries() if e.made and e.storage_key not in keep and self._evictable(e.storage_key)]

    def _evictable(self, key: str) -> bool:
        """Neither a running pull (its lock) nor a pod on this node (the guard) holds the model."""
        if self.busy(key):
            return False
        try:
            self.check_replaceable(key)
        except ModelInUseError:
            return False
        except StoreError:
            pass  # the guard cannot tell: gc's eviction of it raises the guard's own message
        return True

    def _clear_stale_staging(self, max_age: float) -> None:
        assert isinstance(self.layout, NodeLayout)
        base = self.layout.meta / "staging"
        if not base.is_dir():
            return
        now = time.time()
        for folder in base.iterdir():
            if folder.name.startswith(".") or not folder.is_dir():
                continue
            try:
                newest = max((p.stat().st_mtime for p in folder.rglob("*")), default=folder.stat().st_mtime)
            except OSError:
                continue
            if now - newest < max_age:
                continue
            try:
                with self.lock(folder.name, blocking=False):
                    shutil.rmtree(folder, ignore_errors=True)
            except StoreError:
                continue  # a pull is working on it right now

    def free_bytes(self) -> int:
        assert isinstance(self.layout, NodeLayout)
        return shutil.disk_usage(self.layout.root).free

    def verify(self, key: str) -> list[VerifyProblem]:
        """Re-hash every file and compare with the manifest."""
        m = self.manifest(key)
        if m is None:
            return [VerifyProblem("", "no manifest: the model is not (completely) in the store")]
        return self._problems(key, m)

    def _problems(self, key: str, m: Manifest) -> list[VerifyProblem]:
        base = self.layout.model_dir(key)
        problems = []
        for f in m.files:
            p = base / f.path
            try:
                size = p.stat().st_size
            except OSError:
                problems.append(VerifyProblem(f.path, "missing"))
                continue
            if size != f.size:
                problems.append(VerifyProblem(f.path, f"size {size}, manifest says {f.size}"))
                continue
            digest = hash_file(p, size=size).local_hexdigest()
            if digest != f.xxh3:
                problems.append(VerifyProblem(f.path, f"xxh3-128 {digest}, manifest says {f.xxh3}"))
        return problems
