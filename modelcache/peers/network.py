"""This node's side of peer transfer: the downloads peers take part in, and what it serves.

``PeerNetwork.attach`` turns a model's origin source into a :class:`PeerSource` for one
download (``modelcache.pull`` calls it once the model is staged), and is the catalog the peer
server asks: a model being downloaded serves the pieces it has written and hashed; a published
model serves every piece of its record (``pieces.json`` next to the manifest), while present.
Where the peers are comes from a ``directory`` (the agent reads them from the LocalModelNode
objects); nothing here knows Kubernetes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from modelcache.peers.client import PeerClient, PeerInfo
from modelcache.peers.exclusions import Exclusions
from modelcache.peers.local import LocalPieces, ServedRange
from modelcache.peers.pieces import (
    PieceHash,
    PieceLog,
    PieceRecord,
    hash_piece,
    listing_digest,
    piece_count,
    piece_size_for,
    piece_span,
)
from modelcache.peers.protocol import HaveReply
from modelcache.peers.source import PeerSource
from modelcache.peers.swarm import SwarmSession, SwarmSettings, SwarmStats
from modelcache.sources.base import RemoteFile, Source
from modelcache.store import NodeStore, Staging
from modelcache.store.journal import Journal, JournalState

log = logging.getLogger("modelcache.peers")

Directory = Callable[[str], list[PeerInfo]]
#: The store record (``<meta>/peers/excluded.json``) of the peers this node excluded.
EXCLUSIONS_RECORD = "peers"


@dataclass(frozen=True)
class ModelPeerStats:
    """Where a model's bytes came from (a download in flight, or its piece record)."""

    listing_digest: str
    from_origin: int
    from_peers: int
    peers: int = 0  # peers polled right now (in flight only)
    dropped: tuple[str, ...] = ()


class _JournalEvents:
    """Forwards what the engine journals to what this node serves."""

    def __init__(self, local: LocalPieces, session: SwarmSession) -> None:
        self.local, self.session = local, session

    def chunk(self, file_idx: int, chunk_idx: int, done: int) -> None:
        self.local.chunk(file_idx, chunk_idx, done)

    def file_done(self, file_idx: int) -> None:
        self.local.file_done(file_idx)

    def file_reset(self, file_idx: int) -> None:
        # Fetched again after a checksum mismatch or a failed write-back: from the origin (peer
        # bytes may be what was wrong), and nothing of it is served until then.
        self.session.file_reset(file_idx)
        self.local.file_reset(file_idx)


class PeerNetwork:
    def __init__(self, settings: SwarmSettings, directory: Directory, client: PeerClient, store: NodeStore,
                 on_change: Callable[[], None] | None = None,
                 on_exclude: Callable[[str, str], None] | None = None) -> None:
        self.settings, self.directory, self.client, self.store = settings, directory, client, store
        self.on_change = on_change
        self.on_exclude = on_exclude
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[str, SwarmSession]] = {}  # storage key -> (digest, session)
        #: Peers found lying: never asked again, by any download, across restarts (exclusions.py).
        self.exclusions = Exclusions(lambda: store.read_record(EXCLUSIONS_RECORD, "excluded"),
                                     lambda text: store.write_record(EXCLUSIONS_RECORD, "excluded", text))
        self._records: dict[str, tuple[int, PieceRecord | None]] = {}  # key -> (mtime_ns, record)
        self._finished: dict[str, ModelPeerStats] = {}

    # ---- downloads ---------------------------------------------------------------------------

    def attach(self, key: str, origin: Source, files: list[RemoteFile], staging: Staging, journal: Journal,
               chunk_size: int, resume: JournalState, workers: int = 8, stall_timeout: float = 30.0) -> PeerSource:
        digest = listing_digest(origin.resolved_uri, files)
        psize = piece_size_for(chunk_size)
        plog = PieceLog(str(staging.pieces), psize, digest)
        fresh = not resume.files and not resume.chunks
        plog.open(fresh)
        local = LocalPieces(files, staging.data, chunk_size, psize, plog, JournalState() if fresh else resume)
        settings = replace(self.settings, stall_timeout=stall_timeout)
        session = SwarmSession(settings, key, digest, local, self.client, self.directory, self.excluded, self.exclude,
                               workers)
        journal.listener = _JournalEvents(local, session)
        with self._lock:
            self._sessions[key] = (digest, session)
            self._finished.pop(key, None)
        session.start()
        log.info("peer transfer on for model %s (listing %s, pieces of %d bytes, %d peers known)", key, digest,
                 psize, len(session.links))
        self._changed()
        closed = threading.Event()

        def detach() -> None:
            if closed.is_set():
                return
            closed.set()
            journal.listener = None
            session.close()
            plog.close()
            with self._lock:
                if self._sessions.get(key, (None, None))[1] is session:
                    del self._sessions[key]
                self._finished[key] = self._stats_of(digest, session)
            self._changed()

        # (The source's hook is handed the staging folder; the Staging object already names it.)
        return PeerSource(origin, session, detach, lambda _folder: self._write_record(session, staging))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # ---- peers excluded for good -----------------------------------------------------------

    def excluded(self, node: str) -> bool:
        return node in self.exclusions

    def exclude(self, node: str, why: str) -> None:
        """``node`` lied or served a wrong piece: no request of any download goes to it again."""
        if self.exclusions.add(node, why):
            if self.on_exclude is not None:
                self.on_exclude(node, why)
            self._changed()

    def _write_record(self, session: SwarmSession, staging: Staging) -> None:
        """Before publish: every piece hash of the verified model, left in staging for the store.
        Pieces without a hash (fetched by a run without peers, or whose log line was lost) are
        hashed from the staged file, which passed every check by now."""
        local = session.local
        files: dict[str, list[str]] = {}
        sources: dict[str, str] = {}
        for li, f in enumerate(local.files):
            size = local.sizes[li]
            hashes = []
            letters = []
            path = staging.data / f.path
            for p in range(piece_count(size, local.piece_size)):
                h = local.hashes.get((li, p))
                if h is None:
                    start, end = piece_span(size, local.piece_size, p)
                    with open(path, "rb") as fh:
                        h = PieceHash(hash_piece(os.pread(fh.fileno(), end - start, start)), False)
                hashes.append(h.hex)
                letters.append("o" if h.origin else "p")
            files[f.path] = hashes
            sources[f.path] = "".join(letters)
        stats = session.stats
        record = PieceRecord(session.key, session.digest, local.piece_size, files,
                             stats.from_origin, stats.from_peers, sources=sources)
        staging.stage_piece_record(record.to_json())

    @staticmethod
    def _stats_of(digest: str, session: SwarmSession) -> ModelPeerStats:
        s: SwarmStats = session.stats
        with session.cond:
            alive = sum(1 for link in session.links.values() if link.state.alive)
            return ModelPeerStats(digest, s.from_origin, s.from_peers, alive, tuple(s.dropped))

    def stats(self, key: str) -> ModelPeerStats | None:
        """For status and logs: the download in flight, else the last one, else the record."""
        with self._lock:
            live = self._sessions.get(key)
            done = self._finished.get(key)
        if live is not None:
            return self._stats_of(*live)
        if done is not None:
            return done
        record = self._record(key)
        if record is None:
            return None
        return ModelPeerStats(record.listing_digest, record.bytes_from_origin, record.bytes_from_peers)

    # ---- the catalog the peer server reads ---------------------------------------------------------

    def _live(self, key: str, digest: str) -> SwarmSession | None:
        with self._lock:
            found = self._sessions.get(key)
        return found[1] if found is not None and found[0] == digest else None

    def _record(self, key: str) -> PieceRecord | None:
        path = self.store.layout.pieces_path(key)
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            return None
        with self._lock:
            cached = self._records.get(key)
        if cached is not None and cached[0] == mtime:
            return cached[1]
        record: PieceRecord | None = None
        text = self.store.pieces_text(key)
        if text is not None:
            try:
                record = PieceRecord.from_json(text)
            except ValueError as exc:
                log.warning("piece record of model %s is damaged (%s): not served to peers", key, exc)
        if record is not None and record.storage_key != key:
            record = None
        with self._lock:
            self._records[key] = (mtime, record)
        return record

    def _published(self, key: str, digest: str) -> PieceRecord | None:
        """The record of a present model, if it describes exactly the manifest's files (so no
        path outside them is ever opened for a peer)."""
        record = self._record(key)
        if record is None or record.listing_digest != digest or not self.store.is_present(key):
            return None
        manifest = self.store.manifest(key)
        if manifest is None or {f.path: piece_count(f.size, record.piece_size) for f in manifest.files} != {
                p: len(h) for p, h in record.files.items()}:
            return None
        return record

    def have(self, key: str, digest: str, epoch: str, since: int, wait: float) -> HaveReply | None:
        session = self._live(key, digest)
        if session is not None:
            return session.local.have(epoch, since, wait)
        record = self._published(key, digest)
        if record is None:
            return None
        pieces = [(ci, p, h, record.from_origin(path, p)) for ci, path in enumerate(sorted(record.files))
                  for p, h in enumerate(record.files[path])]
        return HaveReply("published", len(pieces), record.piece_size, True, True, pieces, [])

    def range(self, key: str, digest: str, ci: int, start: int, end: int) -> ServedRange | None:
        session = self._live(key, digest)
        if session is not None:
            return session.local.range(ci, start, end)
        record = self._published(key, digest)
        if record is None:
            return None
        paths = sorted(record.files)
        if not 0 <= ci < len(paths):
            return None
        manifest = self.store.manifest(key)
        size = next((f.size for f in manifest.files if f.path == paths[ci]), None) if manifest is not None else None
        if size is None or not 0 <= start < end <= size:
            return None
        return ServedRange(str(self.store.layout.model_dir(key)), paths[ci], start, end, size=size)
