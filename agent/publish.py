"""Writes the agent's status: at once after a state change, else every ``status_interval``.

The sink decides what "write" means (a status PATCH sent only when something differs, or the
standalone status file); progress fields therefore change the written status at most once
per interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from agent.core import Agent

log = logging.getLogger("agent.status")

Sink = Callable[[dict[str, Any]], None]


class Publisher:
    def __init__(self, agent: Agent, sink: Sink, interval: float) -> None:
        self.agent, self.sink, self.interval = agent, sink, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def start(self) -> Publisher:
        self._thread = threading.Thread(target=self._run, name="agent-status", daemon=True)
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self.agent.changed.set()
        if self._thread is not None:
            self._thread.join(10)
        self.publish()  # the last word: the final states

    def publish(self) -> None:
        if not self.agent.spec_seen.is_set():
            return
        try:
            self.sink(self.agent.status())
            self.failures = 0
        except Exception as exc:
            self.failures += 1
            log.warning("status write failed; retrying", extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}})

    def _run(self) -> None:
        while not self._stop.is_set():
            self.agent.changed.wait(self.interval)
            if self._stop.is_set():
                return
            self.agent.changed.clear()
            self.publish()
