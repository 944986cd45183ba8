"""Progress displays: rich bars on a terminal, one plain line every few seconds in logs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from modelcache.runtime.loop import Loop
from modelcache.runtime.progress import ProgressTracker, format_line, human_bytes


@contextmanager
def plain_progress(tracker: ProgressTracker, interval: float, stream: TextIO, label: str = "") -> Iterator[None]:
    """A line every ``interval`` seconds: `kubectl logs` and init-container logs are not TTYs."""

    def line() -> None:
        stream.write(format_line(tracker.snapshot(), label) + "\n")
        stream.flush()

    loop = Loop("modelcache-progress", line, interval, at_start=False).start()
    try:
        yield
    finally:
        loop.stop(timeout=None)


@contextmanager
def bar_progress(tracker: ProgressTracker, stream: TextIO) -> Iterator[None]:
    """A total bar plus one bar per file in flight, refreshed from tracker snapshots."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        ProgressColumn,
        Task,
        TaskID,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class BinaryRate(ProgressColumn):
        """MiB/s, as the plain lines and every other size modelcache prints (rich's own: MB/s)."""

        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_bytes(speed)}/s", style="progress.data.speed")

    progress = Progress(
        TextColumn("{task.description}", justify="left"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        BinaryRate(),
        TimeRemainingColumn(),
        console=Console(file=stream),
        transient=False,
    )
    total_task = progress.add_task("total", total=None)
    file_tasks: dict[str, TaskID] = {}

    def refresh() -> None:
        snap = tracker.snapshot()
        waiting = snap.waiting if snap.waiting and not snap.bytes_total else ""
        progress.update(total_task, completed=snap.bytes_done, total=snap.bytes_total or None,
                        description=waiting or f"total ({snap.files_done}/{snap.files_total} files)")
        active = {f.path: f for f in snap.active if f.path}
        for path, tid in list(file_tasks.items()):
            if path not in active:
                progress.remove_task(tid)
                del file_tasks[path]
        for path, f in active.items():
            name = path if len(path) <= 40 else "..." + path[-37:]
            if path not in file_tasks:
                file_tasks[path] = progress.add_task(name, total=f.total)
            progress.update(file_tasks[path], completed=f.done, total=f.total)

    progress.start()
    loop = Loop("modelcache-bars", refresh, 0.2, at_start=False).start()
    try:
        yield
    finally:
        loop.stop(timeout=None)
        refresh()
        for tid in file_tasks.values():
            progress.remove_task(tid)
        progress.stop()


@contextmanager
def show_progress(tracker: ProgressTracker, mode: str = "auto", interval: float = 5.0,
                  stream: TextIO | None = None, label: str = "") -> Iterator[None]:
    stream = stream or sys.stderr
    if mode == "auto":
        mode = "bar" if stream.isatty() else "plain"
    if mode == "bar":
        with bar_progress(tracker, stream):
            yield
    elif mode == "plain":
        with plain_progress(tracker, interval, stream, label):
            yield
    else:
        yield
