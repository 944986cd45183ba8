"""The one background loop (modelcache/runtime/loop.py) the agent, the coordinator and the progress
lines run on: woken early, stopped without waiting out its interval, alive after a failing step,
a step's own delay honoured."""

from __future__ import annotations

import logging
import threading

import pytest

from modelcache.runtime.loop import Loop
from tests.helpers import wait_until


def test_runs_at_start_then_when_woken_and_stops_at_once() -> None:
    calls: list[int] = []
    loop = Loop("t-wake", lambda: calls.append(1), 3600).start()
    try:
        wait_until(lambda: len(calls) == 1, timeout=10, what="the first step")
        loop.wake.set()  # an hour's interval: only the wake can bring the second step
        wait_until(lambda: len(calls) == 2, timeout=10, what="the woken step")
    finally:
        loop.stop()
    assert not loop.alive()  # stop() did not wait out the hour
    assert len(calls) == 2


def test_a_shared_event_wakes_it_and_at_start_false_waits_for_it() -> None:
    changed = threading.Event()
    calls: list[int] = []
    loop = Loop("t-shared", lambda: calls.append(1), 3600, wake=changed, at_start=False).start()
    try:
        assert calls == []
        changed.set()
        wait_until(lambda: calls == [1], timeout=10, what="the step the shared event woke")
        assert not changed.is_set()  # cleared before the step: a change during it wakes it again
    finally:
        loop.stop()
    assert calls == [1]


def test_a_failing_step_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="modelcache.runtime.loop"):
        loop = Loop("t-fail", step, 0.01).start()
        try:
            wait_until(lambda: len(calls) >= 3, timeout=10, what="steps after the failure")
            assert loop.alive()
        finally:
            loop.stop()
    assert any("t-fail: step failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_step_returns_its_own_next_delay() -> None:
    """What a backoff uses: the returned seconds replace the interval once."""
    calls: list[int] = []

    def step() -> float | None:
        calls.append(1)
        return 0.0 if len(calls) < 5 else None  # four at once, then the hour

    loop = Loop("t-delay", step, 3600).start()
    try:
        wait_until(lambda: len(calls) == 5, timeout=10, what="the steps with no delay")
    finally:
        loop.stop()
    assert len(calls) == 5


def test_stop_from_the_step_itself_and_before_start() -> None:
    Loop("t-never", lambda: None, 1).stop()  # never started: nothing to wait for
    holder: list[Loop] = []
    loop = Loop("t-self", lambda: holder[0].stop(), 3600)
    holder.append(loop)
    loop.start()
    wait_until(lambda: not loop.alive(), timeout=10, what="the loop that stopped itself")
