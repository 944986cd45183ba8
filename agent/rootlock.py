"""One agent per model root.

Two agent processes for one node (a rollout with ``maxSurge``, a force-deleted pod whose
container still runs) would both download, delete and report: their status writes overwrite
each other and the second one's downloads queue behind the first's model locks. So an agent
takes ``<root>/.modelcache/agent.lock`` (``flock``: released by the kernel when the process
ends, however it ends) before it does anything, and a second agent waits politely: it serves
``/healthz`` but is not ready, writes nothing, and takes over as soon as the first one exits.
A stop request ends the wait at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from pathlib import Path

from agent.logs import fields

log = logging.getLogger("agent")


class RootLock:
    def __init__(self, root: Path) -> None:
        self.path = Path(root) / ".modelcache" / "agent.lock"
        self._fd: int | None = None

    def holder(self) -> str:
        """What the holding agent wrote into the lock file (its pid), for the log."""
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def acquire(self, stop: threading.Event, poll: float = 1.0) -> bool:
        """Take the lock, waiting while another agent holds it; False if ``stop`` came first."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        waiting = False
        while not stop.is_set():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waiting:
                    waiting = True
                    log.warning("another agent is running on this root: waiting for it to stop",
                                extra=fields(root=str(self.path.parent.parent), holder_pid=self.holder()))
                stop.wait(poll)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._fd = fd
            if waiting:
                log.info("the other agent stopped: taking over", extra=fields(root=str(self.path.parent.parent)))
            return True
        os.close(fd)
        return False

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
