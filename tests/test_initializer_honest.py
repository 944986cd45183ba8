"""The init container's figures are honest and its cache holds: pairs sharing a DEST stay cached,
a resumed run says what it transferred and what it found on disk, out-of-range settings are one
line per pair. With issue 12's finished DEST (only the model's files in it; completeness an
extended attribute of DEST per storage key), pairs sharing a DEST still stay cached."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

from initializer import finished
from modelcache.sources.uri import storage_key
from modelcache.store.journal import Journal
from tests.fixtures.http import NginxServer
from tests.helpers import REPO, wait_until
from tests.initializer_util import initializer_cmd, initializer_env, run_initializer

pytestmark = pytest.mark.timeout(180)
MiB = 1 << 20


def test_pairs_sharing_a_dest_stay_cached(nginx: NginxServer, tmp_path: Path) -> None:
    nginx.write("p/config.json", 1000, seed=1)
    nginx.write("p/weights.bin", 2 * MiB, seed=2)
    a, b, dest = nginx.url("p/config.json"), nginx.url("p/weights.bin"), tmp_path / "models"
    first = run_initializer(a, dest, b, dest)
    assert first.code == 0, first.output
    assert first.out.count("pulled:") == 2
    # DEST holds exactly the model's files (issue 12: a runtime takes every sub-directory for a
    # model); what each pair produced is an extended attribute of DEST, one per storage key.
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "weights.bin"]
    nginx.clear_access_log()
    again = run_initializer(a, dest, b, dest)
    assert again.code == 0, again.output
    assert again.out.count("cached:") == 2, again.out
    assert nginx.access_log() == []  # not even a listing: both are known complete
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "weights.bin"]


def test_a_resumed_run_reports_transferred_and_resumed_bytes(nginx: NginxServer, tmp_path: Path) -> None:
    nginx.write("slow/m.bin", 8 * MiB, seed=3)
    nginx.set_limit_rate("slow", 1 * MiB)
    uri, dest = nginx.url("slow/m.bin"), tmp_path / "d"
    env = initializer_env({"MODELCACHE_WORKERS": "1", "MODELCACHE_CHUNK_SIZE": "1M"})
    proc = subprocess.Popen([*initializer_cmd(), uri, str(dest)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    staged = dest / ".modelcache" / "staging" / "data" / "m.bin"
    journal = dest / ".modelcache" / "staging" / "journal"
    wait_until(lambda: sum(Journal(str(journal)).load().chunks.values()) >= 3 * MiB, timeout=60,
               what="3 MiB journaled")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert staged.exists()
    nginx.set_limit_rate("slow", 64 * MiB)
    nginx.clear_access_log()
    r = run_initializer(uri, dest, env={"MODELCACHE_WORKERS": "1", "MODELCACHE_CHUNK_SIZE": "1M"})
    assert r.code == 0, r.output
    summary = r.out.strip().splitlines()[-1]
    m = re.fullmatch(r"done: 1/1 pairs ok, 1 file, 8\.0 MiB \(([\d.]+) MiB transferred, ([\d.]+) MiB resumed from "
                     r"an earlier run\) in \S+ \(.+/s\)", summary)
    assert m, summary
    transferred, resumed = float(m.group(1)), float(m.group(2))
    assert resumed >= 3 and abs(transferred + resumed - 8) < 0.05, summary
    served = nginx.bytes_served("slow/m.bin")
    assert abs(served - transferred * MiB) <= 0.05 * MiB + 1, (served, summary)  # the figure is what moved


@pytest.mark.parametrize(("env", "needle"), [
    ({"MODELCACHE_CHUNK_SIZE": "1"}, "environment variable MODELCACHE_CHUNK_SIZE='1': 1 B is outside the allowed "
                                     "range 64.0 KiB to 1.0 GiB"),
    ({"MODELCACHE_CHUNK_SIZE": "100G"}, "MODELCACHE_CHUNK_SIZE='100G': 100.0 GiB is outside the allowed range"),
    ({"MODELCACHE_WORKERS": "100000"}, "MODELCACHE_WORKERS='100000' is above the allowed 256"),
    ({"MODELCACHE_INIT_PARALLEL": "0"}, "MODELCACHE_INIT_PARALLEL 1 to 64"),
])
def test_out_of_range_settings_are_one_line_per_pair(tmp_path: Path, env: dict[str, str], needle: str) -> None:
    r = run_initializer("s3://b/m", tmp_path / "a", "gs://b/m", tmp_path / "b", env=env)
    assert r.code == 1 and "Traceback" not in r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("error: ") and needle in ln for ln in lines), r.err


def test_pairs_sharing_a_dest_without_their_records_are_adopted_not_fetched(nginx: NginxServer,
                                                                            tmp_path: Path) -> None:
    """Where DEST keeps no extended attributes (or they were lost), each pair of a shared DEST
    adopts its own files on a rerun: the other pair's files are left alone, nothing is fetched."""
    nginx.write("q/config.json", 1000, seed=5)
    nginx.write("q/weights.bin", 2 * MiB, seed=6)
    a, b, dest = nginx.url("q/config.json"), nginx.url("q/weights.bin"), tmp_path / "models"
    assert run_initializer(a, dest, b, dest).code == 0
    for uri in (a, b):
        finished.forget(dest, storage_key(uri))
    nginx.clear_access_log()
    again = run_initializer(a, dest, b, dest)
    assert again.code == 0, again.output
    served = {rel: sum(e.bytes_sent for e in nginx.requests_for(rel) if e.range != "bytes=0-0")
              for rel in ("q/config.json", "q/weights.bin")}
    assert served == {"q/config.json": 0, "q/weights.bin": 0}, served  # listed (a probe), never fetched
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "weights.bin"]
    assert all(finished.load(dest, storage_key(uri)) is not None for uri in (a, b))
