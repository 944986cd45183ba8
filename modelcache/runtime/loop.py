"""The one background loop of the project: a daemon thread that runs a step every interval, or
as soon as it is woken, until stopped. The agent's supervisor, status writer and resync, the
coordinator's certificate loops and the progress lines are all one of these.

A step that raises is logged and the loop goes on: a loop thread that dies silently leaves a
process that looks alive and does nothing (``alive()`` is what health checks read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: What a step returns: None to wait the loop's interval, or the seconds to wait this once
#: (a backoff after a failure, a retry sooner than the interval).
Step = Callable[[], float | None]


class Loop:
    """Runs ``step`` on a daemon thread named ``name``: at once when ``at_start`` (else after
    the first interval), then each time ``interval`` seconds pass or ``wake`` is set. ``wake``
    may be an Event others set (a "something changed" signal shared with the rest of the
    process); ``stop()`` sets it too, so a stop never waits out an interval."""

    def __init__(self, name: str, step: Step, interval: float | Callable[[], float], *,
                 wake: threading.Event | None = None, at_start: bool = True,
                 logger: logging.Logger | None = None) -> None:
        self.name = name
        self.step = step
        self._interval = interval if callable(interval) else (lambda: float(interval))
        self.wake = wake if wake is not None else threading.Event()
        self.at_start = at_start
        self.log = logger or log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Loop:
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop after the step under way (if any); waits up to ``timeout`` seconds for it,
        unless called from the step itself."""
        self._stop.set()
        self.wake.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        delay = 0.0 if self.at_start else self._interval()
        while True:
            if delay > 0:
                self.wake.wait(delay)
            if self._stop.is_set():
                return
            self.wake.clear()
            try:
                again = self.step()
            except Exception:
                self.log.exception("%s: step failed (continuing)", self.name)
                again = None
            delay = self._interval() if again is None else again
