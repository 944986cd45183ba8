"""Stream-count adaptation: more streams while throughput grows, back off when it does not."""

from __future__ import annotations

import hashlib
from pathlib import Path

from modelcache.engine.transfer import FileJob, TransferEngine, TransferOptions
from modelcache.engine.transfer_control import StreamLimit
from modelcache.sources.base import open_source
from modelcache.sources.credentials import Settings
from modelcache.store.journal import Journal


def test_hill_climb_keeps_steps_that_pay_and_undoes_those_that_do_not():
    s = StreamLimit(start=4, maximum=12, step=2, gain=0.10, hold=2)
    assert s.observe(100.0, saturated=True) == 6  # first look: probe +2
    assert s.observe(150.0, saturated=True) == 6  # +50%: keep
    assert s.observe(150.0, saturated=True) == 8  # probe again
    assert s.observe(155.0, saturated=True) == 6  # +3% only: undo, then rest
    assert s.observe(155.0, saturated=True) == 6
    assert s.observe(155.0, saturated=True) == 6
    assert s.observe(155.0, saturated=True) == 8  # rested: probe again
    assert s.observe(400.0, saturated=True) == 8
    assert s.observe(400.0, saturated=False) == 8  # streams idle: nothing to learn
    assert s.backoff() == 6  # the server pushed back
    for i in range(20):
        s.observe(1e6 * 2**i, saturated=True)  # every step pays
    assert s.limit == 12  # never past the maximum


def test_grows_streams_against_a_server_that_caps_each_connection(nginx, tmp_path: Path):
    data = nginx.write("capped/w.bin", 8 << 20)
    # 256 KiB/s per connection (after nginx's one-second burst): only more streams go faster.
    nginx.set_limit_rate("capped", 256 << 10)
    source = open_source(nginx.url("capped/w.bin"), Settings.from_env({}))
    (remote,) = source.list_files()
    journal = Journal(str(tmp_path / "journal"))
    journal.open(fresh=True)
    dest = tmp_path / "out" / "w.bin"
    engine = TransferEngine(TransferOptions(workers=2, max_workers=8, chunk_size=1 << 20, adapt_interval=0.3))
    results, errors = engine.run([FileJob(source, remote, str(dest), journal, 0, "g")])
    assert [f.path for f in results["g"]] == ["w.bin"]
    journal.close()
    source.close()
    assert not errors, errors
    assert hashlib.sha256(dest.read_bytes()).digest() == hashlib.sha256(data.read_bytes()).digest()
    assert engine.peak_streams > 2  # it found that more connections meant more bytes


def test_fixed_workers_by_default(tmp_path: Path):
    opts = TransferOptions(workers=3).normalized()
    assert opts.max_workers == 3
    assert TransferEngine(opts).peak_streams == 3
