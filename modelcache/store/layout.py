"""Where a store keeps things: the two layouts (a node root, a destination folder) and safe
walks into a model folder. Only the store builds paths under ``META_DIR``."""

from __future__ import annotations

import os
import stat
from abc import ABC, abstractmethod
from pathlib import Path, PurePosixPath

from modelcache.runtime.reserved import META_DIR


class Layout(ABC):
    """Where one model's folder, manifest, staging area and lock live."""

    #: The store's bookkeeping folder (``META_DIR``): only this package builds paths in it.
    meta: Path

    @abstractmethod
    def model_dir(self, key: str) -> Path: ...

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

    @property
    def staging_root(self) -> Path:
        """Where the store's staged downloads live."""
        return self.meta / "staging"

    def manifest_path(self, key: str) -> Path:
        return self.meta / "manifests" / f"{key}.json"

    def damaged_path(self, key: str) -> Path:
        """The model is damaged (``Damage``): not present, whatever the sizes say, until a pull or a
        repair has put right the files it names."""
        return self.manifest_path(key).with_name(f"{key}.damaged.json")

    def pending_path(self, key: str) -> Path:
        """The manifest of a publish under way: from its writing until the manifest is installed
        the model is not present, and after a crash ``recover`` decides what it describes."""
        return self.staging_dir(key) / "manifest.json"

    def record_path(self, kind: str, key: str) -> Path:
        """A record another part keeps of a model (the initializer's ``unpacked``)."""
        return self.meta / kind / f"{key}.json"


class NodeLayout(Layout):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.meta = self.root / META_DIR

    @property
    def base(self) -> Path:
        return self.root

    @property
    def models(self) -> Path:
        """The folder serving pods read: one sub-folder per storage key."""
        return self.root / "models"

    def model_dir(self, key: str) -> Path:
        return self.models / key

    @property
    def manifests(self) -> Path:
        return self.meta / "manifests"

    def staging_dir(self, key: str) -> Path:
        return self.staging_root / key

    def lock_path(self, key: str) -> Path:
        return self.meta / "locks" / f"{key}.lock"

    def pieces_path(self, key: str) -> Path:
        return self.manifests / f"{key}.pieces.json"

    @property
    def repair_root(self) -> Path:
        return self.meta / "repair"

    def repair_dir(self, key: str) -> Path:
        """Where an in-place repair downloads the damaged files (same file system, resumable)."""
        return self.repair_root / key

    def pin_path(self, key: str) -> Path:
        """The damaged model's manifest, kept until its repair is installed: what it restores."""
        return self.repair_root / f"{key}.pinned.json"

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

    def staging_dir(self, key: str) -> Path:
        return self.staging_root

    def lock_path(self, key: str) -> Path:
        return self.meta / "lock"

    def pieces_path(self, key: str) -> Path:
        return self.meta / "pieces.json"


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
