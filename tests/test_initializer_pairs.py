"""storage-initializer: pairs with different DESTs really run at the same time while pairs on one
DEST (or nested DESTs) never overlap; the periodic progress line and the final summary line;
STORAGE_OVERRIDE_CONFIG laid over STORAGE_CONFIG end to end."""

from __future__ import annotations

import io
import json
import re
import threading
from pathlib import Path
from typing import cast

from initializer.dispatch import Context
from initializer.redact import Scrubber
from initializer.report import PairOutcome, Reporter
from initializer.run import Pair, run_pairs
from tests.fixtures.http import NginxServer
from tests.fixtures.s3 import S3Server
from tests.initializer_util import run_initializer

#: Generous: only reached when the property under test is broken (or the machine is stalled).
WAIT = 20.0


class _Probe:
    """A fake pair runner that records which DESTs are active at once."""

    def __init__(self, dest_of: dict[str, str]) -> None:
        self.dest_of = dest_of
        self.lock = threading.Lock()
        self.active: dict[str, int] = {}
        self.overlaps: list[str] = []
        self.order: list[str] = []
        self.started = {src: threading.Event() for src in dest_of}

    def enter(self, src: str) -> None:
        key = self.dest_of[src]
        with self.lock:
            # Nested DESTs share a key (their top folder) in this test's layout.
            if self.active.get(key, 0):
                self.overlaps.append(src)
            self.active[key] = self.active.get(key, 0) + 1
            self.order.append(src)
        self.started[src].set()

    def leave(self, src: str) -> None:
        with self.lock:
            self.active[self.dest_of[src]] -= 1


def test_different_dests_run_concurrently_and_one_dest_never_twice(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    pairs = [
        Pair(0, "a1", str(a)),
        Pair(1, "b1", str(b)),
        Pair(2, "a2", str(a) + "/"),  # the same folder, spelled differently
        Pair(3, "c1", str(c)),
        Pair(4, "a3", str(a / "sub")),  # nested in a
    ]
    probe = _Probe({"a1": "a", "a2": "a", "a3": "a", "b1": "b", "c1": "c"})
    # a1, b1 and c1 can only pass this barrier if they run at the same time.
    together = threading.Barrier(3, timeout=WAIT)

    def run_one(src: str, dest: Path, ctx: Context) -> PairOutcome:
        probe.enter(src)
        try:
            if src in ("a1", "b1", "c1"):
                together.wait()
            if src == "a1":
                # Were a2 or a3 started beside a1, they would show up here (and as an overlap).
                assert not probe.started["a2"].wait(0.3) and not probe.started["a3"].is_set()
            return PairOutcome("pulled", files=1, bytes=1)
        finally:
            probe.leave(src)

    out, err = io.StringIO(), io.StringIO()
    reporter = Reporter(Scrubber(), interval=60, out=out, err=err)
    result = run_pairs(pairs, cast(Context, None), reporter, max_parallel=4, run_one=run_one)
    assert (result.ok, result.failed) == (5, 0), err.getvalue()
    assert probe.overlaps == []
    # Pairs on one DEST run in argument order.
    assert [s for s in probe.order if s.startswith("a")] == ["a1", "a2", "a3"]
    assert out.getvalue().count("pulled:") == 5 and err.getvalue() == ""


def test_a_failing_pair_does_not_stop_the_next_pair_on_its_dest(tmp_path: Path) -> None:
    pairs = [Pair(0, "bad", str(tmp_path / "d")), Pair(1, "good", str(tmp_path / "d"))]

    def run_one(src: str, dest: Path, ctx: Context) -> PairOutcome:
        if src == "bad":
            raise OSError(2, "No such file or directory", "/x")
        return PairOutcome("pulled", files=1)

    out, err = io.StringIO(), io.StringIO()
    result = run_pairs(pairs, cast(Context, None), Reporter(Scrubber(), out=out, err=err), run_one=run_one)
    assert (result.ok, result.failed) == (1, 1)
    assert err.getvalue().splitlines() == [f"error: bad -> {tmp_path / 'd'}: No such file or directory (/x)"]


_SIZE = r"\d+(?:\.\d)? (?:B|KiB|MiB|GiB)"
PROGRESS = re.compile(
    rf"^progress: +\d+\.\d% {_SIZE}/{_SIZE} files \d+/\d+ {_SIZE}/s eta (?:\?|\d+[hms].*)$"
)


def test_progress_lines_while_bytes_move_and_one_summary_line(nginx: NginxServer, tmp_path: Path) -> None:
    size = 3 << 20
    nginx.write("paced/model.bin", size)
    nginx.set_limit_rate("paced", 1 << 20)  # one connection (one chunk): ~3 s
    r = run_initializer(
        nginx.url("paced/model.bin"), tmp_path / "d",
        env={"MODELCACHE_WORKERS": "1", "MODELCACHE_CHUNK_SIZE": "16M", "MODELCACHE_PROGRESS_INTERVAL": "0.5"},
    )
    assert r.code == 0, r.output
    lines = r.out.strip().splitlines()
    progress = [line for line in lines if line.startswith("progress:")]
    assert len(progress) >= 2, r.out
    for line in progress:
        assert PROGRESS.match(line), line
    # Bytes, rate and ETA move: a later line shows more bytes than the first, and a non-zero rate.
    pct = [float(line.split()[1].rstrip("%")) for line in progress]
    assert pct == sorted(pct) and pct[-1] > pct[0], progress
    assert all(" 0.0 B/s" not in line and " 0 B/s" not in line for line in progress)
    summary = r"^done: 1/1 pairs ok, 1 file, 3\.0 MiB \(\S+ \S+ transferred\) in \S+ \(.+/s\)$"
    assert re.match(summary, lines[-1]), lines[-1]
    assert sum(line.startswith(("done:", "FAILED:")) for line in lines) == 1
    assert sum(line.startswith("pulled:") for line in lines) == 1


def test_storage_override_config_replaces_keys_of_the_spec(moto_s3: S3Server, tmp_path: Path) -> None:
    bucket = moto_s3.new_bucket()
    moto_s3.client().put_object(Bucket=bucket, Key="m/w.bin", Body=b"weights")
    wrong = "WrongSpecSecret" + "y" * 20
    spec = {
        "type": "s3",
        "access_key_id": moto_s3.access_key,
        "secret_access_key": wrong,
        "endpoint_url": moto_s3.endpoint,
        "region": moto_s3.region,
    }
    env = {"STORAGE_CONFIG": json.dumps(spec)}
    r = run_initializer(f"s3://{bucket}/m", tmp_path / "bad", env=env)
    assert r.code == 1, r.output  # the spec alone carries a wrong secret
    env["STORAGE_OVERRIDE_CONFIG"] = json.dumps({"secret_access_key": moto_s3.secret_key})
    r = run_initializer(f"s3://{bucket}/m", tmp_path / "d", env=env)
    assert r.code == 0, r.output
    assert (tmp_path / "d" / "w.bin").read_bytes() == b"weights"
    assert wrong not in r.output and moto_s3.secret_key not in r.output
