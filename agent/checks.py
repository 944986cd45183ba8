"""Periodic checks of downloaded models: sizes often (stats only), a full re-hash rarely.

Both run on one background thread, never on the supervisor's, so a multi-hour hash of a big
root does not delay downloads or status. A damaged model is handed to ``on_damaged``
(``Agent.damaged``: it reports it and downloads it again); a drift found or gone to
``on_changed`` (the status is written). The checker is given callbacks, not the Agent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from agent.config import AgentConfig
from agent.credentials import Credentials
from agent.logs import fields
from agent.state import ModelRecord
from modelcache.runtime.redact import scrub_urls
from modelcache.store import NodeStore

log = logging.getLogger("agent.checks")


class Checker:
    def __init__(self, store: NodeStore, cfg: AgentConfig, credentials: Credentials,
                 on_damaged: Callable[[ModelRecord, str], None], on_changed: Callable[[], None]) -> None:
        self.store, self.cfg, self.credentials = store, cfg, credentials
        self.on_damaged, self.on_changed = on_damaged, on_changed
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="check")
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def maybe_check(self, rec: ModelRecord, now: float) -> None:
        cfg = self.cfg
        full = cfg.verify_interval > 0 and now - rec.last_verify >= cfg.verify_interval
        sizes = cfg.size_check_interval > 0 and now - rec.last_size_check >= cfg.size_check_interval
        drift = cfg.drift_check_interval > 0 and now - rec.last_drift_check >= cfg.drift_check_interval
        if not (full or sizes or drift):
            return
        with self._lock:
            if rec.key in self._busy:
                return
            self._busy.add(rec.key)
        if drift:
            rec.last_drift_check = now
            if not (full or sizes):
                self.pool.submit(self._drift, rec)
                return
            self.pool.submit(self._drift, rec, False)
        rec.last_size_check = now
        if full:
            rec.last_verify = now
        self.pool.submit(self._check, rec, full)

    def _drift(self, rec: ModelRecord, release: bool = True) -> None:
        """List the model's source with its entry's credentials and compare it with the manifest:
        a changed source is reported (status detail ``drift``, a log line), never applied, since
        pods are reading the files (``modelcache pull --refresh`` on the node, or a new cache)."""
        from modelcache.drift import CHANGED
        from modelcache.pull import check_drift

        try:
            manifest = self.store.manifest(rec.key)
            if manifest is None or not rec.entries:
                return
            with self.credentials.settings_for(rec.entries[0]) as settings:
                found = check_drift(rec.uri, manifest, settings)
            drift = found.message if found.state == CHANGED else ""
            if drift != rec.drift:
                rec.drift = drift
                self.on_changed()
                if drift:
                    log.warning("the source changed since the download; serving what was downloaded",
                                extra=fields(storage_key=rec.key, drift=drift))
            log.info("drift check done", extra=fields(storage_key=rec.key, state=found.state))
        except Exception as exc:
            log.info("drift check failed", extra=fields(storage_key=rec.key,
                                                        error=scrub_urls(" ".join(str(exc).split()))[:300]))
        finally:
            if release:
                with self._lock:
                    self._busy.discard(rec.key)

    def _check(self, rec: ModelRecord, full: bool) -> None:
        try:
            store = self.store
            if full:
                problems = store.verify(rec.key)
                problem = "; ".join(f"{p.path}: {p.problem}" if p.path else p.problem for p in problems[:3])
            else:
                problem = "" if store.is_present(rec.key) else "a file is missing or has the wrong size"
            log.info("check done", extra=fields(storage_key=rec.key, kind="verify" if full else "sizes",
                                                ok=not problem))
            if problem:
                self.on_damaged(rec, problem)
        except Exception as exc:
            log.warning("check failed", extra=fields(storage_key=rec.key, error=str(exc)))
        finally:
            with self._lock:
                self._busy.discard(rec.key)
