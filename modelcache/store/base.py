"""What both store kinds share: the per-model lock, reading a model's state, an atomic publish
and its recovery after a crash, damage marks, removal.

A model is present only when its manifest exists, no publish of it is under way (a pending
manifest in its staging folder), it is not marked damaged, and the folder matches the manifest
(every file there with its size). A publish writes the pending manifest first, then swaps the
folder (or merges into it), then installs the manifest: a crash in any step leaves a model that
is not present until ``recover`` has either put back the old state or checked the new folder
against the pending manifest, never a manifest over other bytes. A folder the store knew (a
manifest, damaged or not, a damage mark, a repair) is never taken for one someone else filled
(``knew``, ``record``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from modelcache.runtime.clock import rfc3339
from modelcache.store import steps
from modelcache.store.diskio import atomic_write, fsync_dir, store_error
from modelcache.store.layout import Layout
from modelcache.store.locks import busy, model_lock
from modelcache.store.manifest import Manifest, VerifyProblem, problems, read_manifest
from modelcache.store.staging import Staging

log = logging.getLogger("modelcache.store")

#: ``guard(key, folder)``: raise to refuse replacing or deleting a model folder (the CLI's check
#: that no pod on the node mounts it, modelcache.store.mountusers; the agent asks the API instead).
Guard = Callable[[str, Path], None]


@dataclass(frozen=True)
class Damage:
    """What the store knows of a damaged model (``NodeStore.mark_damaged``)."""

    #: Files found damaged (empty: not known which, e.g. a size check saw one differ).
    files: tuple[str, ...]
    reason: str
    since: str


def discard(path: Path) -> None:
    """Delete a folder moved to the trash; a link moved there goes as a link, never what it names."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


class Store(ABC):
    """One store of models (``NodeStore``: a node root; ``DestStore``: a destination folder).
    The kinds differ only in the hooks below the line ``---- what the kinds decide``."""

    #: A publish merges the staged files into the folder (which stays) instead of swapping it.
    merges: bool = False

    def __init__(self, layout: Layout, guard: Guard | None = None) -> None:
        self.layout = layout
        self.guard = guard

    def staging(self, key: str) -> Staging:
        """The model's staged download (``Staging``): the only way to its files."""
        return Staging(self.layout.staging_dir(key))

    def check_replaceable(self, key: str) -> None:
        """Before a model folder that exists is replaced or deleted: the guard may refuse."""
        folder = self.layout.model_dir(key)
        if self.guard is not None and folder.exists():
            self.guard(key, folder)

    # ---- what the kinds decide ----------------------------------------------------------------

    def _pin(self, key: str) -> Path | None:
        """A repair's pin (node stores)."""
        return None

    def _repair_records(self, key: str) -> list[Path]:
        """A repair's pin and download (node stores)."""
        return []

    def _kept_aside(self, key: str) -> list[Path]:
        """What adoption moved out of the model folder (node stores)."""
        return []

    def _nothing_left(self, key: str) -> bool:
        """Asked as the model's lock is released: True lets its lock file go too."""
        return False

    def _before_recover(self, key: str) -> None:
        """What a crash may have left beyond a publish: a node store's trash and an old pin."""
        return None  # the default (a destination folder): nothing beyond the publish

    def _after_recover(self, key: str, staging: Staging) -> None:
        """No publish was under way: a node store drops a staging folder that holds no download."""
        return None  # the default (a destination folder): its staging folder is left as it is

    def _trash_dir(self, target: Path) -> Path:
        """Where a folder goes to be deleted (the rename is instant, the delete is not)."""
        return target.parent

    @abstractmethod
    def unlisted_dir(self, key: str) -> Path:
        """Where files an adopted folder held beyond its model were moved."""

    def set_aside_unlisted(self, key: str, keep: Collection[str]) -> list[str]:
        """Move what the model folder holds beyond ``keep`` out of it (node stores)."""
        return []

    def foreign_names(self, key: str) -> list[str]:
        """What the model folder holds besides the store's own bookkeeping."""
        return os.listdir(self.layout.model_dir(key))

    def drop_staging(self, key: str) -> None:
        """Remove a staged download that holds nothing worth resuming (caller holds the lock)."""
        self.staging(key).discard()

    def record_failure(self, key: str, reason: str, message: str) -> None:
        """Keep why the staged download of ``key`` failed (until the next pull of it starts)."""
        self.staging(key).record_failure(reason, message)

    @abstractmethod
    def no_room_advice(self, key: str, need: int, short: int, fs_total: int, margin: int) -> str:
        """The fix to name when a model needs ``need`` bytes (margin included), ``short`` more
        than are free, on a file system of ``fs_total`` bytes."""

    # ---- locking ------------------------------------------------------------------------------

    def lock(self, key: str, blocking: bool = True, cancel: threading.Event | None = None,
             on_wait: Callable[[str], None] | None = None) -> contextlib.AbstractContextManager[None]:
        """Exclusive per-model lock across processes: two pulls of one model download once.

        A blocking wait with ``cancel`` polls instead of sleeping in ``flock``, so setting it ends
        the wait (CancelledError): a process told to stop is never stuck behind another's pull.
        The holder writes its pid into the lock file, so a process that must wait (``on_wait``
        is told whom it waits for) and ``modelcache ls`` can say which process has the model.
        Nothing of the model left when it is released (removed, evicted, a pull refused before
        it staged a byte): its lock file goes too.
        """
        return model_lock(self.layout.lock_path(key), self.layout.base, key, blocking, cancel, on_wait,
                          lambda: self._nothing_left(key))

    def busy(self, key: str) -> bool:
        """Another process holds the model's lock right now (a pull in flight). Creates nothing."""
        return busy(self.layout.lock_path(key))

    # ---- reading ------------------------------------------------------------------------------

    def manifest(self, key: str) -> Manifest | None:
        return read_manifest(self.layout.manifest_path(key), key)

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
        paths = [self.layout.manifest_path(key), self.layout.damaged_path(key), *self._repair_records(key)]
        return any(os.path.lexists(p) for p in paths)

    def record(self, key: str, sealed: bool = False) -> Manifest | None:
        """What the store last recorded of the model's folder, to check the files against: a
        repair's pin (kept by an older version), else the manifest, read even if its seal broke
        (a damaged record can only make a file fail its digest and be fetched again) unless
        ``sealed``."""
        for path in (self._pin(key), self.layout.manifest_path(key)):
            m = read_manifest(path, key, sealed=sealed) if path is not None else None
            if m is not None:
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

    def has(self, key: str) -> bool:
        """Anything of the model in the store: manifest, folder, staged download, repair in
        progress. Creates nothing."""
        layout = self.layout
        paths = [layout.manifest_path(key), layout.model_dir(key), layout.staging_dir(key), layout.damaged_path(key),
                 *self._repair_records(key), *self._kept_aside(key)]
        return any(p.exists() for p in paths)

    def made(self, key: str) -> bool:
        """Whether this store made the model (or is making it): its manifest, a repair's pin or
        download, a staged download or publish, or a folder claimed for a download container.
        A folder under ``models/`` without any of these was put there by someone else (KServe's
        node agent, a user's copy): gc and the agent never delete it; only ``rm`` of its name."""
        layout = self.layout
        paths = [layout.manifest_path(key), layout.staging_dir(key), layout.damaged_path(key),
                 *self._repair_records(key), *self._kept_aside(key)]
        return any(p.exists() for p in paths)

    def claim(self, key: str) -> None:
        """Record that the model folder is being filled for this store by someone else's code
        (a download container): until its manifest is installed, the folder counts as ours."""
        self.staging(key).claim()

    def failure(self, key: str) -> str | None:
        """Why the staged download of ``key`` failed (``reason: message``), or None."""
        return self.staging(key).failure()

    def clear_failure(self, key: str) -> None:
        self.staging(key).clear_failure()

    def disk_usage(self, key: str) -> int:
        """Bytes the files in the model folder take (their sizes; links not followed)."""
        total = 0
        for dirpath, _dirs, files in os.walk(self.layout.model_dir(key)):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_size
        return total

    def verify(self, key: str) -> list[VerifyProblem]:
        """Re-hash every file and compare with the manifest."""
        m = self.manifest(key)
        if m is None:
            return [VerifyProblem("", "no manifest: the model is not (completely) in the store")]
        return problems(self.layout.model_dir(key), m)

    # ---- writing ------------------------------------------------------------------------------

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
        self._before_recover(key)
        staging = self.staging(key)
        pending = self.layout.pending_path(key)
        if not pending.exists():
            self._after_recover(key, staging)
            return
        try:
            manifest: Manifest | None = Manifest.from_json(pending.read_text())
        except (OSError, ValueError, TypeError, KeyError):
            manifest = None
        if manifest is not None and manifest.storage_key != key:
            return  # another model's publish (pairs that share a DEST share its staging folder)
        data = staging.data
        target = self.layout.model_dir(key)
        try:
            if manifest is not None and staging.merging.exists() and data.exists():
                self._merge_into(data, target)
                shutil.rmtree(data)
            if manifest is None or data.exists() or not target.is_dir():
                pending.unlink()  # the folder is as it was before this publish
                staging.merging.unlink(missing_ok=True)
                fsync_dir(str(staging.dir))
                return
            found = problems(target, manifest)
            self._forget_repair(key)  # the folder they described was replaced
            if found:
                log.warning("an interrupted publish left files that do not match its manifest; marked damaged",
                            extra={"fields": {"storage_key": key, "files": ",".join(p.path for p in found[:20])}})
                self.mark_damaged(key, [p.path for p in found], "after an interrupted publish: "
                                  + "; ".join(f"{p.path}: {p.problem}" for p in found[:3]))
            self._install_manifest(key, pending)
        except OSError as exc:
            raise store_error(exc, str(target), "recovering an interrupted publish") from exc
        staging.discard()

    def publish(self, key: str, manifest: Manifest, in_place: bool = False) -> Path:
        """Move the staged files into place and install the manifest. Caller holds the lock.

        ``in_place``: the model folder exists and holds the rest of the model (adoption): each
        staged file is renamed into it, the folder itself stays (a pod may mount it).

        The steps (``PUBLISH_STEPS``): the pending manifest is written (from then on the model is
        not present); an in-place merge is marked as started; the folder is swapped (one rename)
        or merged into; the damage mark and repair records of the replaced folder go; the piece
        record (left in staging by a download that peers took part in, else the older one goes:
        it would describe other bytes) and the manifest are installed. A crash between any two
        is finished or undone by ``recover``.
        """
        staging = self.staging(key)
        data = staging.data
        target = self.layout.model_dir(key)
        pending = self.layout.pending_path(key)
        trash: Path | None = None
        try:
            atomic_write(pending, manifest.to_json())
            steps.reached("pending")
            if self.merges or in_place:
                staging.merging.touch()
                fsync_dir(str(staging.dir))
                steps.reached("merging")
                self._merge_into(data, target)
                # Only emptied folders are left; gone, they tell ``recover`` that the files are in
                # place if we die before the manifest is.
                shutil.rmtree(data)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.exists() or target.is_symlink():  # an unlisted or damaged copy: replace it whole
                    self.check_replaceable(key)  # (again: a pod may have mounted it meanwhile)
                    trash = staging.dir.parent / f".trash-{key}-{time.time_ns()}"
                    os.rename(target, trash)
                os.rename(data, target)
                fsync_dir(str(target.parent))
            steps.reached("swapped")
            self._forget_repair(key)
            steps.reached("cleared")
            if staging.piece_record.exists():
                self.layout.pieces_path(key).parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging.piece_record, self.layout.pieces_path(key))
            else:
                self.layout.pieces_path(key).unlink(missing_ok=True)
            self._install_manifest(key, pending)
            steps.reached("installed")
        except OSError as exc:
            raise store_error(exc, str(target), "publishing") from exc
        if trash is not None:  # deleted once the new folder is in place (a big model takes a while)
            discard(trash)
        staging.discard()
        return target

    def install_manifest(self, key: str, manifest: Manifest) -> None:
        """Write ``manifest`` for a folder already in place (caller holds the lock): durable, then
        renamed into place, so a reader sees no manifest or the whole one. It describes the
        folder as it is: any damage mark or repair record of an earlier one goes."""
        pending = self.layout.pending_path(key)
        try:
            atomic_write(pending, manifest.to_json())
            self.layout.pieces_path(key).unlink(missing_ok=True)  # an older record would describe other bytes
            self._forget_repair(key)
            self._install_manifest(key, pending)
        except OSError as exc:
            raise store_error(exc, str(pending), "writing the manifest") from exc
        self.staging(key).discard()

    def invalidate(self, key: str) -> None:
        """The model's manifest goes (caller holds the lock): the folder stops being present and
        the next pull checks it as a folder the store knew."""
        self.layout.manifest_path(key).unlink(missing_ok=True)

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
                Store._merge_into(entry, dst)
                continue
            if dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst)
            elif dst.exists() or dst.is_symlink():
                dst.unlink()
            os.rename(entry, dst)
        fsync_dir(str(target))

    # ---- damage -------------------------------------------------------------------------------

    def mark_damaged(self, key: str, files: Iterable[str] = (), reason: str = "") -> None:
        """Mark the model damaged (``Damage``): it stops being present for every reader, its
        manifest stays as the record of what it was (what a repair restores, what a pull checks
        the folder against). Files already marked stay marked."""
        old = self.damage(key)
        names = sorted({*(old.files if old else ()), *files})
        doc = {"files": names, "reason": reason or (old.reason if old else "damaged"),
               "since": old.since if old and old.since else rfc3339()}
        try:
            atomic_write(self.layout.damaged_path(key), json.dumps(doc, indent=1))
        except OSError as exc:
            raise store_error(exc, str(self.layout.damaged_path(key)), "marking the model damaged") from exc

    def _forget_repair(self, key: str) -> None:
        """The folder they described is gone or fixed: its damage mark and repair records go too."""
        self.layout.damaged_path(key).unlink(missing_ok=True)

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
                discard(trash)
            staging = self.staging(key)
            if staging.dir.exists():
                staging.discard()
                removed = True
            for aside in self._kept_aside(key):
                if aside.exists():
                    shutil.rmtree(aside, ignore_errors=True)  # removed by name: with it
                    removed = True
            # An unfinished repair and the damage mark go with their model.
            if self.layout.damaged_path(key).exists() or any(p.exists() for p in self._repair_records(key)):
                removed = True
            self._forget_repair(key)
        return removed

    # ---- records of other parts (the initializer's) -------------------------------------------

    def write_record(self, kind: str, key: str, text: str) -> None:
        """Keep ``text`` as the ``kind`` record of a model (``<meta>/<kind>/<key>.json``):
        written whole, fsynced and renamed into place, so a reader finds the old one or this."""
        path = self.layout.record_path(kind, key)
        try:
            atomic_write(path, text)
        except OSError as exc:
            raise store_error(exc, str(path), f"writing the {kind} record") from exc

    def read_record(self, kind: str, key: str) -> str | None:
        try:
            return self.layout.record_path(kind, key).read_text()
        except OSError:
            return None
