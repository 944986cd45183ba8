"""Peers this node found lying, kept across downloads and restarts (docs/peers.md, "Trust
nothing from a peer").

A peer is excluded when it sent bytes that do not match its own word, or said it read a piece
from the origin with a hash other than the one the origin's bytes have (we read that piece from
the origin, or fetched the file again after its checksum failed); one that only passed a piece
on is excluded for a wrong hash only when no witness vouched for it (plan.py, ``settle``). It is
not asked anything again, by any download, for ``ttl`` (a day by default: a node repaired by its
operator comes back by itself; one still lying is excluded again at its first piece). The list
lives in the store (``<root>/.modelcache/peers/excluded.json``) and the agent publishes it in its
LocalModelNode status, where other nodes read it and skip those peers too.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

log = logging.getLogger("modelcache.peers")

#: How long an exclusion lasts (seconds), and how many are kept (the oldest go first).
EXCLUSION_TTL = 24 * 3600.0
MAX_EXCLUSIONS = 256
#: Longest reason kept (it names a piece, two hashes and a node).
MAX_REASON = 300


@dataclass(frozen=True)
class Exclusion:
    node: str
    reason: str
    since: float  # wall clock (time.time())
    until: float


class Exclusions:
    """The excluded peers; ``load``/``save`` read and write their JSON (the store's record)."""

    def __init__(self, load: Callable[[], str | None] = lambda: None, save: Callable[[str], None] = lambda text: None,
                 ttl: float = EXCLUSION_TTL, clock: Callable[[], float] = time.time) -> None:
        self._save, self.ttl, self.clock = save, ttl, clock
        self._lock = threading.Lock()
        self._items: dict[str, Exclusion] = {}
        text = load()
        if text:
            try:
                for doc in json.loads(text).get("excluded", []):
                    item = Exclusion(str(doc["node"]), str(doc["reason"])[:MAX_REASON], float(doc["since"]),
                                     float(doc["until"]))
                    self._items[item.node] = item
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("the list of excluded peers is damaged (%s); starting an empty one", exc)
                self._items = {}

    def __contains__(self, node: object) -> bool:
        with self._lock:
            item = self._items.get(str(node))
            return item is not None and item.until > self.clock()

    def add(self, node: str, reason: str) -> bool:
        """Exclude ``node``; False if it was already (the first reason stays)."""
        now = self.clock()
        with self._lock:
            old = self._items.get(node)
            if old is not None and old.until > now:
                return False
            self._items[node] = Exclusion(node, reason[:MAX_REASON], now, now + self.ttl)
            live = sorted((i for i in self._items.values() if i.until > now), key=lambda i: i.since)
            self._items = {i.node: i for i in live[-MAX_EXCLUSIONS:]}
            text = json.dumps({"version": 1, "excluded": [asdict(i) for i in self._items.values()]}, indent=1)
        try:
            self._save(text)
        except Exception as exc:  # a full or read-only disk: still excluded for this agent's lifetime
            log.warning("could not keep the list of excluded peers (%s); it lasts until the agent restarts", exc)
        return True

    def items(self) -> list[Exclusion]:
        now = self.clock()
        with self._lock:
            return sorted((i for i in self._items.values() if i.until > now), key=lambda i: i.since)
