"""The node store: one root that serving pods read, many models, kept by the agent or the CLI.

Beyond ``Store`` it lists its models (``keys``, ``entries``), evicts them (``gc``), knows the
folders someone else put there (``foreign``), belongs to one agent (``mark_agent_owned``) and
repairs a damaged model in place (``pin_damaged`` … ``end_repair``, modelcache.repair).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from modelcache.errors import ModelInUseError, StoreError
from modelcache.runtime.clock import rfc3339
from modelcache.runtime.progress import human_bytes
from modelcache.store import steps
from modelcache.store.base import Guard, Store, discard
from modelcache.store.dest import DestStore
from modelcache.store.diskio import atomic_write, fsync_dir, store_error
from modelcache.store.layout import DestLayout, NodeLayout
from modelcache.store.manifest import Manifest, file_matches
from modelcache.store.staging import StagedPull, Staging

log = logging.getLogger("modelcache.store")


class TargetUnreachableError(StoreError):
    """gc: even evicting every model would not free ``target`` bytes."""

    reason = "TargetUnreachable"

    def __init__(self, target: int, free: int, reclaimable: int, models: int) -> None:
        self.target, self.free, self.reclaimable, self.models = target, free, reclaimable, models
        super().__init__(
            f"--target-free {human_bytes(target)} cannot be reached: {human_bytes(free)} is free and evicting "
            f"every model not in use ({models}, {human_bytes(reclaimable)}) would make it "
            f"{human_bytes(free + reclaimable)}; nothing was evicted. Lower --target-free, or add --evict-all "
            "to evict them all anyway"
        )


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


class NodeStore(Store):
    layout: NodeLayout

    def __init__(self, layout: NodeLayout, guard: Guard | None = None) -> None:
        super().__init__(layout, guard)

    @classmethod
    def at(cls, root: str | os.PathLike[str], guard: Guard | None = None) -> NodeStore:
        return cls(NodeLayout(Path(root)), guard)

    # ---- what this kind decides (``Store``) ---------------------------------------------------

    def _pin(self, key: str) -> Path | None:
        return self.layout.pin_path(key)

    def _repair_records(self, key: str) -> list[Path]:
        return [self.layout.pin_path(key), self.layout.repair_dir(key)]

    def _kept_aside(self, key: str) -> list[Path]:
        return [self.layout.unlisted_dir(key)]

    def _nothing_left(self, key: str) -> bool:
        # Nothing of the model is left (removed, evicted, a pull refused before it staged a byte).
        return not self.has(key)

    def _before_recover(self, key: str) -> None:
        self._restore_legacy_pin(key)
        for trash in self.layout.staging_root.glob(f".trash-{key}-*"):  # a replaced folder not deleted yet
            discard(trash)

    def _after_recover(self, key: str, staging: Staging) -> None:
        if staging.exists() and not staging.holds_download() and self.layout.manifest_path(key).exists():
            staging.discard()  # a publish done but for its clean-up

    def _trash_dir(self, target: Path) -> Path:
        """Out of ``models/``, which serving pods and ``ls`` read."""
        d = self.layout.staging_root
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _forget_repair(self, key: str) -> None:
        super()._forget_repair(key)
        self.layout.pin_path(key).unlink(missing_ok=True)
        shutil.rmtree(self.layout.repair_dir(key), ignore_errors=True)

    def unlisted_dir(self, key: str) -> Path:
        return self.layout.unlisted_dir(key)

    def no_room_advice(self, key: str, need: int, short: int, fs_total: int, margin: int) -> str:
        """A gc only where evicting the models made here can make the room; else what can."""
        root = self.layout.root
        if fs_total < need:
            return (f"this file system ({human_bytes(fs_total)} in all) is too small for the model plus the margin: "
                    "pull it into a larger one (--root)" + (", or lower --space-margin" if margin else ""))
        evictable = self.evictable(keep={key})
        reclaimable = sum(e.size for e in evictable)
        foreign = [(e.storage_key, e.size) for e in self.entries() if not e.made]
        if evictable and reclaimable >= short:
            # The exact target, rounded up to a MiB: gc then frees enough for this pull, margin included.
            return f"free space, e.g. `modelcache gc --root {root} --target-free {-(-need // (1 << 20))}M`"
        held = ""
        if foreign:
            held = (f"; {len(foreign)} folder(s) under {root}/models, not made by modelcache, hold "
                    f"{human_bytes(sum(size for _k, size in foreign))} (`modelcache ls --root {root}` names them; "
                    "only `modelcache rm` of a name deletes one)")
        if evictable:
            return (f"evicting every model not in use ({len(evictable)}, {human_bytes(reclaimable)}) would not make "
                    f"{human_bytes(short)} more free: free space on the file system by other means{held}")
        return ("no model of this store can be evicted to make room: free space on the file system by other "
                f"means{held}")

    # ---- listing ------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        found: set[str] = set()
        if self.layout.manifests.is_dir():  # not <key>.pieces.json
            found |= {p.stem for p in self.layout.manifests.glob("*.json") if "." not in p.stem}
        models = self.layout.models
        if models.is_dir():  # a dot folder is never a model (a trash folder left by a crash)
            found |= {p.name for p in models.iterdir() if p.is_dir() and not p.name.startswith(".")}
        return sorted(found)

    def disk_keys(self) -> set[str]:
        """Every storage key this store made something of under the root: published, staged
        (a download, or a publish a crash interrupted), or under repair (its folder or its pin).
        A folder under ``models/`` that none of these records is not ours (``foreign``)."""
        keys = {k for k in self.keys() if self.made(k)}
        for folder in (self.layout.staging_root, self.layout.repair_root):
            if folder.is_dir():
                keys |= {p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}
        suffix = self.layout.pin_path("").name  # a repair's pin outlives a crash: its model is on disk too
        if self.layout.repair_root.is_dir():
            keys |= {p.name.removesuffix(suffix) for p in self.layout.repair_root.glob("*" + suffix)}
        return keys

    def foreign(self) -> list[str]:
        """The folders under ``models/`` that this store did not make (see ``made``)."""
        return [k for k in self.keys() if not self.made(k)]

    def agent_owned(self) -> bool:
        """An agent took this root before (its mark, or the root lock an earlier agent left)."""
        return self.layout.agent_root_path().exists() or self.layout.root_lock_path().exists()

    def mark_agent_owned(self, by: str) -> None:
        """The agent takes the root: it deletes every model its spec does not list from now on."""
        path = self.layout.agent_root_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"by": by, "at": rfc3339()}) + "\n")
        except OSError as exc:
            raise store_error(exc, str(path), "marking the root as the agent's") from exc

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
            known = m or self.pinned_manifest(key)
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

    def staged(self) -> list[StagedPull]:
        """Every staged download, with the bytes its journal says are on disk."""
        base = self.layout.staging_root
        out = []
        for folder in sorted(base.iterdir()) if base.is_dir() else []:
            if folder.name.startswith(".") or not folder.is_dir():
                continue
            staging = Staging(folder)
            seen = staging.progress()
            if seen is None:
                continue  # not (yet) a staged engine download: an extraction, or one just starting
            uri, done, total, files = seen
            out.append(StagedPull(folder.name, uri, done, total, files, self.busy(folder.name),
                                  staging.failure() or ""))
        return out

    # ---- adoption -----------------------------------------------------------------------------

    def set_aside_unlisted(self, key: str, keep: Collection[str]) -> list[str]:
        """Move every file and link of the model folder that is not in ``keep`` (what the model is)
        out of it, into ``unlisted_dir`` (caller holds the lock): pods must see the model and only
        the model, and what someone else left there is kept, not deleted. A linked sub-folder
        goes whole (as the link). (A destination folder is left alone: pairs that share it each
        list only their own files.)"""
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

    def clear_bookkeeping(self) -> None:
        """Refused: a node root keeps its bookkeeping (only a ``DestStore`` is finished so)."""
        raise StoreError(f"{self.layout.root} is a node store root: only a destination store is finished by "
                         "removing its bookkeeping")

    # ---- in-place repair ----------------------------------------------------------------------
    # A damaged model is fixed inside its folder (pods keep reading it): it is marked damaged
    # (not present for any reader; its manifest stays as the pin, what the repair restores), the
    # damaged files are downloaded into ``repair/<key>`` and renamed in, then the manifest is
    # written again and the mark goes. Every step here survives a crash: the mark and the repair
    # folder say what is left to do (modelcache.repair). A repair that is refused (the source
    # moved on) leaves the model marked damaged, its manifest in place and no download behind.

    def _restore_legacy_pin(self, key: str) -> None:
        """An older version took a damaged model's manifest away as the repair's pin; today the
        manifest stays, marked damaged. A pin left without a manifest goes back (caller holds the lock)."""
        pin = self.layout.pin_path(key)
        final = self.layout.manifest_path(key)
        if pin.exists() and not final.exists():
            self.mark_damaged(key, (), "a repair was under way")
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(pin, final)
            fsync_dir(str(final.parent))
        elif pin.exists():
            pin.unlink()

    def pin_damaged(self, key: str, files: Iterable[str] = (), reason: str = "") -> Manifest | None:
        """Mark a damaged model (it stops being present for every reader of the store) and return
        its manifest, kept as the repair's pin. The caller holds the model's lock."""
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
        folder = self.layout.repair_dir(key)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def downloaded_manifest(self, folder: Path, key: str) -> Manifest | None:
        """The manifest a pull into ``folder`` (a repair download) left there."""
        return DestStore(DestLayout(folder)).manifest(key)

    def repair_underway(self, key: str) -> bool:
        """A repair download was started (a crash may have interrupted it)."""
        return self.layout.repair_dir(key).exists()

    def drop_repair_download(self, key: str) -> None:
        shutil.rmtree(self.layout.repair_dir(key), ignore_errors=True)

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
        steps.reached("repair-renamed")
        # A publish that crashed before its manifest left one pending in staging: it describes the
        # folder as it was then, not as repaired, and ``recover`` must never find it later.
        self.staging(key).discard()
        # Still marked damaged while the manifest is written: a crash in between repairs again
        # (every file matches by then: only the manifest and the mark are left to do).
        atomic_write(self.layout.manifest_path(key), manifest.to_json())
        steps.reached("repair-installed")
        self._forget_repair(key)
        return replaced, removed

    def end_repair(self, key: str) -> None:
        """The repair is installed (or abandoned with its model): its mark, pin and download go."""
        self._forget_repair(key)

    # ---- eviction -----------------------------------------------------------------------------

    def clear_trash(self) -> None:
        """Delete trash folders a crash left between a rename and its delete."""
        for folder in (self.layout.staging_root, self.layout.models):
            if folder.is_dir():
                for p in folder.glob(".trash-*"):
                    discard(p)

    def gc(self, target_free: int, dry_run: bool = False, keep: frozenset[str] = frozenset(),
           stale_staging_after: float = 24 * 3600, evict_all: bool = False) -> list[StoreEntry]:
        """Evict least recently used models until ``target_free`` bytes are free.

        Staged downloads nobody has touched for ``stale_staging_after`` seconds (abandoned: the
        URI was never pulled again) are deleted first; a running pull holds its model's lock
        and is never touched. A target that evicting every model would still not reach raises
        ``TargetUnreachableError`` and evicts nothing, unless ``evict_all``: emptying a node
        for nothing is never what a typo in the target meant.
        """
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
        base = self.layout.staging_root
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
        return shutil.disk_usage(self.layout.root).free
