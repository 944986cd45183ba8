"""A model's staged download: the one object that names the files of a staging folder.

A download is staged beside the models, on the same file system (publish is a rename)::

    <staging>/data/        the files in flight, at their paths in the model
    <staging>/plan.json    the listing and chunk size they were staged for (a resume needs the same)
    <staging>/journal      what landed (modelcache.store.journal): what a resume skips
    <staging>/pieces, pieces.json   the peers' piece log and the record publish installs
    <staging>/extract/, unpacked/   a layout extracting itself, an archive being unpacked
    <staging>/failed.json, claimed, merging, manifest.json   a failure, a claim, a publish under way

The pull and the peers reach these only through ``Staging``; tests/test_store_owns_meta.py
rejects the names anywhere else in the product.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from modelcache.runtime.clock import rfc3339
from modelcache.store.diskio import atomic_write, store_error
from modelcache.store.journal import Journal, JournalState

#: Every name the store gives an entry of a staging folder (the rule's test reads this).
STAGING_NAMES = frozenset({"data", "plan.json", "journal", "pieces", "pieces.json", "extract", "unpacked",
                           "failed.json", "claimed", "merging", "manifest.json"})


@dataclass
class Prepared:
    """A staging folder made ready for a download: started afresh (``fresh``) or resumed, with
    its open journal and what the journal says has landed."""

    fresh: bool
    journal: Journal
    resume: JournalState


class Staging:
    """One model's staging folder (``NodeStore.staging``). Callers hold the model's lock."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder

    @property
    def data(self) -> Path:
        """The files in flight, at their paths in the model: what publish moves into place."""
        return self.dir / "data"

    @property
    def plan(self) -> Path:
        return self.dir / "plan.json"

    @property
    def journal(self) -> Path:
        return self.dir / "journal"

    @property
    def pieces(self) -> Path:
        """The peers' piece log of this download (``modelcache.peers.pieces.PieceLog``)."""
        return self.dir / "pieces"

    @property
    def piece_record(self) -> Path:
        """A download's piece record (peers), left here for ``publish`` to install."""
        return self.dir / "pieces.json"

    @property
    def merging(self) -> Path:
        """Present while a publish merges into a folder that stays (``recover`` finishes it)."""
        return self.dir / "merging"

    @property
    def failed(self) -> Path:
        return self.dir / "failed.json"

    def exists(self) -> bool:
        return self.dir.is_dir()

    # ---- a download ---------------------------------------------------------------------------

    def prepare(self, plan: dict[str, object]) -> Prepared:
        """Reuse what is staged only if it was staged for exactly this ``plan`` (listing and chunk
        size); else start afresh. The plan is written whole (a crash leaves the old one or it)."""
        try:
            fresh = json.loads(self.plan.read_text()) != plan
        except (OSError, ValueError):
            fresh = True
        if fresh and self.dir.exists():
            shutil.rmtree(self.dir)
        self.data.mkdir(parents=True, exist_ok=True)
        if fresh:
            atomic_write(self.plan, json.dumps(plan))
        self.clear_failure()  # this attempt's outcome replaces the last one's
        journal = Journal(str(self.journal))
        return Prepared(fresh, journal, JournalState() if fresh else journal.load())

    def bytes_needed(self, files: Sequence[tuple[str, int | None]], skip: Collection[int] = ()) -> int:
        """Bytes the download still has to allocate: preallocated staged files already hold theirs."""
        need = 0
        for i, (path, size) in enumerate(files):
            if i in skip:
                continue
            try:
                have = (self.data / path).stat().st_size
            except OSError:
                have = 0
            need += max(0, (size or 0) - have)
        return need

    def drop_file(self, rel: str) -> None:
        """A staged copy of a file that is not to be fetched (kept in the model folder instead)."""
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            (self.data / rel).unlink()

    def empty_data(self) -> Path:
        """``data`` emptied (a tree that was only compared, never published)."""
        shutil.rmtree(self.data, ignore_errors=True)
        self.data.mkdir(parents=True)
        return self.data

    def extract_dir(self) -> Path:
        """A new, empty folder beside ``data`` for a layout that extracts itself: a source may
        decline, and then a resumable staged download in ``data`` must survive."""
        return self._scratch(self.dir / "extract")

    def unpack_dir(self) -> Path:
        """Where a model that is one archive is unpacked (not created: the unpacker makes it)."""
        return self._scratch(self.dir / "unpacked")

    @staticmethod
    def _scratch(folder: Path) -> Path:
        if folder.exists():
            shutil.rmtree(folder)
        return folder

    def replace_data(self, tree: Path, resumable: bool = True) -> Path:
        """Make ``tree`` (``extract_dir``, ``unpack_dir``) the staged files. ``resumable=False``: the plan and
        journal go first, so a crash restarts the download instead of resuming files that are gone."""
        if not resumable:
            for path in (self.plan, self.journal):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        shutil.rmtree(self.data, ignore_errors=True)
        tree.replace(self.data)
        return self.data

    def stage_piece_record(self, text: str) -> None:
        """Leave a download's piece record here (durable, renamed into place): ``publish``
        installs it next to the manifest, in the same step as the model."""
        try:
            atomic_write(self.piece_record, text)
        except OSError as exc:
            raise store_error(exc, str(self.piece_record), "writing the piece record") from exc

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- a failure, a claim -------------------------------------------------------------------
    # A failed pull keeps what it staged (the next pull of the URI resumes from it) and says why
    # it failed, so ``ls`` does not call it "interrupted".

    def record_failure(self, reason: str, message: str) -> None:
        if not self.dir.is_dir():
            return
        with contextlib.suppress(OSError):
            self.failed.write_text(json.dumps({"reason": reason, "message": message, "at": rfc3339()}))

    def failure(self) -> str | None:
        """Why the staged download failed (``reason: message``), or None."""
        try:
            doc = json.loads(self.failed.read_text())
            return f"{doc['reason']}: {doc['message']}"
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def clear_failure(self) -> None:
        self.failed.unlink(missing_ok=True)

    def claim(self) -> None:
        """The model folder is being filled for the store by someone else's code."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "claimed").touch()
        except OSError as exc:
            raise store_error(exc, str(self.dir), "claiming the model folder") from exc

    def holds_download(self) -> bool:
        """Staged files (or an extraction) are here: not just a publish's leftovers."""
        return self.data.exists() or (self.dir / "extract").exists()

    # ---- what ``ls`` shows --------------------------------------------------------------------

    def progress(self) -> tuple[str, int, int, int] | None:
        """(uri, bytes done, bytes total, files) by the plan and journal; None where no engine
        download is staged (an extraction, or one just starting)."""
        try:
            plan = json.loads(self.plan.read_text())
            files = [(str(f[0]), int(f[1] or 0)) for f in plan["files"]]
            chunk = int(plan["chunk_size"])
        except (OSError, ValueError, TypeError, KeyError, IndexError):
            return None
        state = Journal(str(self.journal)).load()
        done = 0
        for i, (_path, size) in enumerate(files):
            if i in state.files:
                done += size
            else:
                done += sum(min(n, chunk) for (fi, _c), n in state.chunks.items() if fi == i)
        total = sum(size for _p, size in files)
        return str(plan.get("uri") or ""), min(done, total), total, len(files)


@dataclass(frozen=True)
class StagedPull:
    """A download staged in a node store: running now (another process holds its lock) or
    interrupted (resumed by the next pull of its URI)."""

    storage_key: str
    uri: str
    bytes_done: int
    bytes_total: int
    files: int
    running: bool
    #: Why its last attempt failed ("reason: message"); "" for one that was interrupted.
    failure: str = ""

    @property
    def state(self) -> str:
        """pulling (a process holds it now), failed (with ``failure``) or interrupted."""
        return "pulling" if self.running else "failed" if self.failure else "interrupted"

    @property
    def percent(self) -> float:
        return 100.0 * self.bytes_done / self.bytes_total if self.bytes_total else 0.0
