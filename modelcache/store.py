"""The node store: staged downloads, atomic publish, manifests, locks, eviction.

Layout under one root (DESIGN.md)::

    <root>/models/<storageKey>/...                 the model, exactly as serving pods see it
    <root>/.modelcache/manifests/<storageKey>.json what was published, with per-file digests
    <root>/.modelcache/manifests/<storageKey>.pieces.json  piece hashes, for peers (modelcache.peers)
    <root>/.modelcache/staging/<storageKey>/       data/ (in-flight files), plan.json, journal
    <root>/.modelcache/locks/<storageKey>.lock     flock: one writer per model per machine

A model is present only when its manifest exists and the folder matches it (every file there
with its size). Publishing renames the staged folder into place, then the manifest, so a crash
leaves staging or an unlisted folder, never a half model that looks complete. The initializer
uses the same code with ``DestLayout``: the model folder is the destination itself and the
bookkeeping lives in ``<dest>/.modelcache/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import posixpath
import re
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from modelcache.diskio import fsync_dir, store_error
from modelcache.errors import CancelledError, ModelInUseError, StoreError
from modelcache.integrity import hash_file
from modelcache.lockscope import check_exclusive

#: Our bookkeeping folder, beside ``models/`` in a node root and inside DEST while an init container runs.
META_DIR = ".modelcache"

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

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        doc = asdict(self)
        for f in doc["files"]:
            if f.get("version") is None:
                f.pop("version", None)  # the manifests of sources without versions stay as they were
        doc["seal"] = seal_of(doc)
        return json.dumps(doc, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse and check a manifest; anything malformed is a ValueError (the model then counts
        as absent and is fetched again): a damaged manifest is never trusted, and its paths never
        name anything outside the model folder."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("files"), list):
            raise ValueError("not a manifest")
        # Any damage to a sealed manifest (a flipped digit of a size or digest) is caught here;
        # a manifest of version 1 predates the seal and is only checked field by field.
        seal = data.pop("seal", None)
        if (seal is not None or data.get("version") != 1) and seal != seal_of(data):
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
        return cls(files=files, **data)


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


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


@dataclass(frozen=True)
class VerifyProblem:
    path: str
    problem: str


class Layout(ABC):
    """Where one model's folder, manifest, staging area and lock live."""

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

    def unpacked_record_path(self, key: str) -> Path:
        """The initializer's record of what unpacking the model's archive produced."""
        return self.meta / "unpacked" / f"{key}.json"
    def pieces_path(self, key: str) -> Path:
        return self.meta / "pieces.json"


#: ``guard(key, folder)``: raise to refuse replacing or deleting a model folder (the CLI's check
#: that no pod on the node mounts it, modelcache.mountusers; the agent asks the API instead).
Guard = Callable[[str, Path], None]


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
        writable = True
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            try:  # a read-only store still locks through an existing lock file (flock needs no write)
                fd = os.open(path, os.O_RDONLY)
                writable = False
            except OSError:
                raise store_error(exc, str(path), "locking") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                if not blocking:
                    raise ModelInUseError(
                        f"model {key} is in use by another modelcache process{_holder(fd)} (a pull or rm); "
                        "retry when it is done"
                    ) from exc
                if on_wait is not None:
                    on_wait(f"waiting for another modelcache process{_holder(fd)} that holds model {key} "
                            "(a pull or rm of the same URI) to finish")
                if cancel is not None:
                    _flock_until(fd, cancel, key)
                else:
                    fcntl.flock(fd, fcntl.LOCK_EX)
            if writable:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)

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

    def has(self, key: str) -> bool:
        """Anything of the model in the store: manifest, folder or staged download. Creates nothing."""
        layout = self.layout
        return any(p.exists() for p in (layout.manifest_path(key), layout.model_dir(key), layout.staging_dir(key)))

    # ---- reading ----------------------------------------------------------------------

    def manifest(self, key: str) -> Manifest | None:
        try:
            m = Manifest.from_json(self.layout.manifest_path(key).read_text())
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return m if m.storage_key == key else None

    def is_present(self, key: str) -> bool:
        """Manifest there and every listed file there with its size (cheap: stats only)."""
        m = self.manifest(key)
        if m is None:
            return False
        base = self.layout.model_dir(key)
        for f in m.files:
            try:
                if (base / f.path).stat().st_size != f.size:
                    return False
            except OSError:
                return False
        return True

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

    def entries(self) -> list[StoreEntry]:
        out = []
        for key in self.keys():
            m = self.manifest(key)
            try:
                used = self.layout.manifest_path(key).stat().st_mtime
            except OSError:
                used = 0.0
            out.append(
                StoreEntry(
                    storage_key=key,
                    uri=m.uri if m else "",
                    size=m.total_size if m else 0,
                    files=len(m.files) if m else 0,
                    created_at=m.created_at if m else "",
                    last_used=used,
                    present=self.is_present(key),
                )
            )
        return out

    # ---- writing ----------------------------------------------------------------------

    def recover(self, key: str) -> None:
        """Finish a publish that a crash interrupted between its two renames.

        The pending manifest is installed only if the folder holds exactly what it lists (every
        file hashed: this runs only after such a crash). A stale one, say from a crash before an
        in-place repair moved the folder to another revision, would otherwise vouch for files
        it does not describe; it is dropped, and the model is fetched again.
        """
        staging = self.layout.staging_dir(key)
        pending = staging / "manifest.json"
        if pending.exists() and not (staging / "data").exists() and self.layout.model_dir(key).exists():
            try:
                manifest: Manifest | None = Manifest.from_json(pending.read_text())
            except (OSError, ValueError, TypeError, KeyError):
                manifest = None
            if manifest is not None and manifest.storage_key == key and not self._problems(key, manifest):
                self._install_manifest(key, pending)
            shutil.rmtree(staging, ignore_errors=True)

    def publish(self, key: str, manifest: Manifest, in_place: bool = False) -> Path:
        """Move ``staging/data`` into place and install the manifest. Caller holds the lock.

        ``in_place``: the model folder exists and holds the rest of the model (adoption): each
        staged file is renamed into it, the folder itself stays (a pod may mount it).

        A piece record left in staging (``pieces.json``, by a download that peers took part in)
        is installed next to the manifest first; without one, an older record goes: it would
        describe other bytes.
        """
        staging = self.layout.staging_dir(key)
        data = staging / "data"
        target = self.layout.model_dir(key)
        pending = staging / "manifest.json"
        try:
            pieces = staging / "pieces.json"
            if pieces.exists():
                self.layout.pieces_path(key).parent.mkdir(parents=True, exist_ok=True)
                os.replace(pieces, self.layout.pieces_path(key))
            else:
                self.layout.pieces_path(key).unlink(missing_ok=True)
            pending.write_text(manifest.to_json())
            with open(pending, "rb") as f:
                os.fsync(f.fileno())
            if isinstance(self.layout, DestLayout) or in_place:
                self._merge_into(data, target)
                # Only emptied folders are left; gone, they tell ``recover`` that the files are in
                # place if we die before the manifest is (else the model is fetched again).
                shutil.rmtree(data)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.exists():  # an unlisted or damaged copy: replace it whole
                    self.check_replaceable(key)  # (again: a pod may have mounted it meanwhile)
                    trash = staging.parent / f".trash-{key}-{time.time_ns()}"
                    os.rename(target, trash)
                    shutil.rmtree(trash, ignore_errors=True)
                os.rename(data, target)
                fsync_dir(str(target.parent))
            self._install_manifest(key, pending)
        except OSError as exc:
            raise store_error(exc, str(target), "publishing") from exc
        shutil.rmtree(staging, ignore_errors=True)
        return target

    def install_manifest(self, key: str, manifest: Manifest) -> None:
        """Write ``manifest`` for a folder already in place (caller holds the lock): durable, then
        renamed into place, so a reader sees no manifest or the whole one."""
        staging = self.layout.staging_dir(key)
        staging.mkdir(parents=True, exist_ok=True)
        pending = staging / "manifest.json"
        try:
            with open(pending, "w") as out:
                out.write(manifest.to_json())
                out.flush()
                os.fsync(out.fileno())
            self.layout.pieces_path(key).unlink(missing_ok=True)  # an older record would describe other bytes
            self._install_manifest(key, pending)
        except OSError as exc:
            raise store_error(exc, str(pending), "writing the manifest") from exc
        shutil.rmtree(staging, ignore_errors=True)

    def _install_manifest(self, key: str, pending: Path) -> None:
        final = self.layout.manifest_path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(pending, final)
        fsync_dir(str(final.parent))

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
        """Delete a model: the manifest first (it stops being present), then its files."""
        removed = False
        with self.lock(key, blocking=False):
            self.check_replaceable(key)  # before anything changes: refused, the model stays whole
            mpath = self.layout.manifest_path(key)
            if mpath.exists():
                mpath.unlink()
                removed = True
            self.layout.pieces_path(key).unlink(missing_ok=True)
            target = self.layout.model_dir(key)
            if target.exists():
                trash = self._trash_dir(target) / f".trash-{key}-{time.time_ns()}"
                os.rename(target, trash)
                shutil.rmtree(trash, ignore_errors=True)
                removed = True
            staging = self.layout.staging_dir(key)
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
                removed = True
        return removed

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
                    shutil.rmtree(p, ignore_errors=True)

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
        if not evict_all:
            free = self.free_bytes()
            candidates = [e for e in self.entries() if e.storage_key not in keep and self._evictable(e.storage_key)]
            reclaimable = sum(e.size for e in candidates)
            if free < target_free and free + reclaimable < target_free:
                raise TargetUnreachableError(target_free, free, reclaimable, len(candidates))
        if not dry_run:
            self.clear_trash()
            self._clear_stale_staging(stale_staging_after)
        free = self.free_bytes()
        evicted: list[StoreEntry] = []
        for entry in sorted(self.entries(), key=lambda e: e.last_used):
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
