"""Progress accounting: rates, ETA and the log line, including the first look and resumes."""

from __future__ import annotations

import time

from modelcache.runtime.progress import ProgressTracker, format_line, human_bytes, human_duration


def test_first_snapshot_has_a_rate_and_eta():
    t = ProgressTracker()
    t.add_total(1000, 1)
    time.sleep(0.1)
    t.advance("f", 500)
    snap = t.snapshot()
    assert 1000 < snap.rate < 20_000  # ~5000 B/s, not 0 on the first look
    assert snap.eta is not None and 0 < snap.eta < 1


def test_resumed_bytes_are_done_but_not_in_the_rate():
    t = ProgressTracker()
    t.add_total(10_000, 1)
    t.skip(9_000)
    time.sleep(0.1)
    t.advance("f", 100)
    snap = t.snapshot()
    assert snap.bytes_done == 9_100
    assert snap.rate < 5_000  # ~1000 B/s, not 91000


def test_windowed_rate_and_log_line():
    t = ProgressTracker()
    t.add_total(4 << 20, 2)
    t.file_started("m\x00a.bin", 4 << 20)
    t.snapshot()
    time.sleep(0.3)
    t.advance("m\x00a.bin", 1 << 20)
    snap = t.snapshot()
    assert [f.path for f in snap.active] == ["a.bin"]
    line = format_line(snap, "pull ")
    assert line.startswith("pull  25.0% 1.0 MiB/4.0 MiB files 0/2 ") and " eta " in line
    t.file_finished("m\x00a.bin")
    assert t.snapshot().files_done == 1 and t.snapshot().active == ()


def test_human_units():
    assert human_bytes(512) == "512 B" and human_bytes(3 << 30) == "3.0 GiB"
    assert human_duration(None) == "?" and human_duration(3725) == "1h02m05s" and human_duration(65) == "1m05s"
