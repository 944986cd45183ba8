"""Writes the agent's status: at once after a state change, else every ``status_interval``.

The sink decides what "write" means (a status PATCH sent only when something differs, or the
standalone status file); progress fields therefore change the written status at most once
per interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agent.core import Agent
from modelcache.runtime.loop import Loop

log = logging.getLogger("agent.status")

Sink = Callable[[dict[str, Any]], None]


class Publisher:
    def __init__(self, agent: Agent, sink: Sink, interval: float) -> None:
        self.agent, self.sink, self.interval = agent, sink, interval
        # Woken by the agent's "changed" signal; the first write waits for a change or an interval.
        self._loop = Loop("agent-status", self.publish, interval, wake=agent.changed, at_start=False, logger=log)
        self.failures = 0

    def start(self) -> Publisher:
        self._loop.start()
        return self

    def alive(self) -> bool:
        return self._loop.alive()

    def stop(self) -> None:
        self._loop.stop(10)
        self.publish()  # the last word: the final states

    def publish(self) -> None:
        if not self.agent.spec_seen.is_set():
            return
        try:
            status = self.agent.status()
            self.agent.report.update_gauges(status)  # before the write: whoever sees it sees them too
            self.sink(status)
            self.failures = 0
            self.agent.metrics.status_published.set(time.time())  # "not reporting" alert: its age
        except Exception as exc:
            self.failures += 1
            log.warning("status write failed; retrying", extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}})
