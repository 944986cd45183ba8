"""A user's first day with the CLI: a typo is one clear line and loses nothing, gc never empties a
node for an unreachable target, Ctrl-C keeps the staged bytes and says how to resume, work in
flight is visible, figures are honest."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from modelcache.pull import SPACE_MARGIN
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.fixtures.http import NginxServer
from tests.helpers import mounted_tmpfs, wait_until
from tests.pull_helpers import MiB, popen_cli, run_cli

pytestmark = pytest.mark.timeout(180)


def errors(stderr: str) -> list[str]:
    assert "Traceback" not in stderr and "Aborted!" not in stderr and "Usage:" not in stderr, stderr
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def model(folder: Path, size: int = 100_000) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "w.bin").write_bytes(os.urandom(size))
    return str(folder)


@pytest.mark.parametrize(("args", "needle"), [
    (["--chunk-size", "1"], "'--chunk-size': 1 B is outside the allowed range 64.0 KiB to 1.0 GiB"),
    (["--chunk-size", "100G"], "'--chunk-size': 100.0 GiB is outside the allowed range"),
    (["--chunk-size", "1G", "--workers", "256"], "--workers 256 x --chunk-size 1.0 GiB needs 384.0 GiB of "
                                                 "transfer buffers"),
    (["--stall-timeout", "0"], "'--stall-timeout': 0.0 is not in the range 0.5<=x<=3600"),
    (["--progress-interval", "0"], "'MODELCACHE_PROGRESS_INTERVAL'): 0.0 is not in the range 0.1<=x<=3600"),
    (["--workers", "8", "--max-workers", "4"], "'--max-workers': 4 is below --workers 8"),
    (["--dest", "DEST"], "--root and --dest exclude each other"),
])
def test_every_bad_pull_flag_is_one_line_and_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    src = model(tmp_path / "src")
    args = [str(tmp_path / "dest") if a == "DEST" else a for a in args]
    if needle.startswith("--workers 256"):
        from modelcache.engine.resources import available_memory

        have = available_memory()
        assert have is not None and have < 384 << 30  # what the refusal is about (this machine)
    proc = run_cli("pull", src, "--root", str(tmp_path / "root"), *args)
    assert proc.returncode == 2, proc.stderr
    (line,) = errors(proc.stderr)
    assert needle in line, line
    assert not (tmp_path / "root").exists() and not (tmp_path / "dest").exists()


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["rm", "0123456789abcdef"], ["gc", "--target-free", "1G"]])
def test_a_missing_root_is_one_line_and_creates_nothing(tmp_path: Path, command: list[str]) -> None:
    typo = tmp_path / "typo"
    proc = run_cli(*command, "--root", str(typo))
    assert proc.returncode == 2, proc.stderr
    assert errors(proc.stderr) == [f"error: --root {typo} does not exist: no model store there; point --root "
                                   "(or MODELCACHE_ROOT) at the store's root"]
    assert not typo.exists()


def test_rm_of_a_uri_that_is_not_stored_fails_and_creates_no_lock(tmp_path: Path) -> None:
    src = model(tmp_path / "src")
    root = tmp_path / "root"
    assert run_cli("pull", src, "--root", str(root), "--progress", "none").returncode == 0
    locks = sorted(p.name for p in (root / ".modelcache" / "locks").iterdir())
    typo = src + "x"
    proc = run_cli("rm", typo, "--root", str(root))
    assert proc.returncode == 1
    assert errors(proc.stderr) == [f"error: {typo}: not in the store at {root} (nothing was pulled from this exact "
                                   "URI or key; `modelcache ls` lists what is there)"]
    assert sorted(p.name for p in (root / ".modelcache" / "locks").iterdir()) == locks
    assert NodeStore.at(root).is_present(storage_key(src))
    proc = run_cli("rm", src, "--root", str(root))
    assert proc.returncode == 0 and proc.stdout.strip() == f"{src}: removed"


def test_gc_refuses_a_target_it_cannot_reach_unless_told_to_evict_everything(tmp_path: Path) -> None:
    root = tmp_path / "root"
    srcs = [model(tmp_path / f"src{i}", 200_000) for i in range(2)]
    for s in srcs:
        assert run_cli("pull", s, "--root", str(root), "--progress", "none").returncode == 0
    for extra in ([], ["--dry-run"]):
        proc = run_cli("gc", "--root", str(root), "--target-free", "1000T", *extra)
        assert proc.returncode == 1, proc.stderr
        (line,) = errors(proc.stderr)
        assert line.startswith(f"error: gc at {root}: --target-free 1000.0 TiB cannot be reached: ")
        assert "evicting every model not in use (2, 390.6 KiB) would make it" in line
        assert "nothing was evicted. Lower --target-free, or add --evict-all" in line
        assert line.endswith(" (dry run)") == bool(extra)
        assert all(NodeStore.at(root).is_present(storage_key(s)) for s in srcs)
    proc = run_cli("gc", "--root", str(root), "--target-free", "1000T", "--evict-all", "--dry-run")
    assert proc.returncode == 0 and proc.stdout.count("would evict") == 2
    assert all(NodeStore.at(root).is_present(storage_key(s)) for s in srcs)
    proc = run_cli("gc", "--root", str(root), "--target-free", "1000T", "--evict-all")
    assert proc.returncode == 0 and proc.stdout.count("evicted") == 2, proc.stderr
    assert "short of the target 1000.0 TiB (--evict-all)" in proc.stderr
    assert not any(NodeStore.at(root).is_present(storage_key(s)) for s in srcs)


def test_space_error_names_the_margin_and_the_exact_gc_that_makes_room(nginx: NginxServer, tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "fs", "size=160m") as root:
        nginx.write("s/old.bin", 40 * MiB, seed=1)
        nginx.write("s/new.bin", 70 * MiB, seed=2)
        old, new = nginx.url("s/old.bin"), nginx.url("s/new.bin")
        assert run_cli("pull", old, "--root", str(root), "--progress", "none").returncode == 0
        proc = run_cli("pull", new, "--root", str(root), "--progress", "none")
        assert proc.returncode == 1
        (line,) = errors(proc.stderr)
        want = -(-(70 * MiB + SPACE_MARGIN) // MiB)
        m = re.fullmatch(rf"error: {re.escape(new)}: insufficient space at {re.escape(str(root))}: need 70\.0 MiB "
                         r"plus a 64\.0 MiB margin kept free, ([\d.]+) MiB free; free space, e\.g\. "
                         rf"`(modelcache gc --root {re.escape(str(root))} --target-free {want}M)`", line)
        assert m, line
        assert 100 < float(m.group(1)) < 121  # what df says: the margin is not hidden in it
        gc = run_cli(*m.group(2).split()[1:])
        assert gc.returncode == 0 and f"evicted {storage_key(old)}" in gc.stdout, gc.stderr
        again = run_cli("pull", new, "--root", str(root), "--progress", "none")
        assert again.returncode == 0, again.stderr


def test_ctrl_c_exits_130_keeps_the_staged_bytes_and_says_how_to_resume(nginx: NginxServer, tmp_path: Path) -> None:
    nginx.write("slow/w.bin", 8 * MiB, seed=3)
    nginx.set_limit_rate("slow", 1 * MiB)
    uri, root = nginx.url("slow/w.bin"), tmp_path / "root"
    proc = popen_cli("pull", uri, "--root", str(root), "--progress", "none", "--workers", "1", "--chunk-size", "1M")
    staging = root / ".modelcache" / "staging" / storage_key(uri)

    def staged() -> bool:
        from modelcache.pull import staged_pulls

        return any(s.bytes_done >= 2 * MiB for s in staged_pulls(NodeStore.at(root)))

    wait_until(staged, timeout=60, what="2 MiB staged")
    ls = run_cli("ls", "--root", str(root))  # a pull in flight is visible, with its percentage
    assert re.search(rf"^{storage_key(uri)}\s+pulling \d+%\s+8\.0 MiB\s+1\s+{re.escape(uri)}$", ls.stdout, re.M), \
        ls.stdout
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    (line,) = errors(err)
    m = re.fullmatch(rf"error: interrupted: ([\d.]+) MiB of 8\.0 MiB are staged in {re.escape(str(root))}/"
                     r"\.modelcache/staging and kept; run the same command again to resume from there", line)
    assert m and float(m.group(1)) >= 2, line
    assert staging.is_dir()
    ls = run_cli("ls", "--root", str(root))
    assert re.search(rf"^{storage_key(uri)}\s+interrupted (\d+)%", ls.stdout, re.M), ls.stdout
    pct = int(re.search(r"interrupted (\d+)%", ls.stdout).group(1))  # type: ignore[union-attr]
    assert 20 <= pct < 100
    assert "interrupted pulls resume where they stopped" in ls.stderr
    nginx.set_limit_rate("slow", 64 * MiB)
    nginx.clear_access_log()
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none", "--chunk-size", "1M")
    assert again.returncode == 0, again.stderr
    assert nginx.bytes_served("slow/w.bin") <= 8 * MiB - 2 * MiB + 1  # resumed (+ the listing's 1-byte probe)


def test_a_waiting_pull_says_what_it_waits_for(nginx: NginxServer, tmp_path: Path) -> None:
    nginx.write("slow/x.bin", 12 * MiB, seed=4)  # ~11 s at 1 MiB/s: the second pull starts well within
    nginx.set_limit_rate("slow", 1 * MiB)
    uri, root = nginx.url("slow/x.bin"), tmp_path / "root"
    first = popen_cli("pull", uri, "--root", str(root), "--progress", "none", "--workers", "1", "--chunk-size", "1M")
    try:
        wait_until(lambda: NodeStore.at(root).busy(storage_key(uri)), timeout=30, what="the first pull's lock")
        second = run_cli("pull", uri, "--root", str(root), "--progress", "plain", "--progress-interval", "0.2")
    finally:
        first.communicate(timeout=60)
    assert second.returncode == 0, second.stderr
    assert re.search(rf"^{re.escape(uri)}: waiting for another modelcache process \(pid {first.pid}\) that holds "
                     rf"model {storage_key(uri)} \(a pull or rm of the same URI\) to finish$", second.stderr, re.M), \
        second.stderr
    assert "cached" in second.stderr.splitlines()[-1]


def test_a_source_spelled_differently_is_named(tmp_path: Path) -> None:
    src, root = model(tmp_path / "m"), tmp_path / "root"
    assert run_cli("pull", src, "--root", str(root), "--progress", "none").returncode == 0
    for other in (src + "/", f"file://{src}"):
        proc = run_cli("pull", other, "--root", str(root), "--progress", "none")
        assert proc.returncode == 0, proc.stderr
        assert (f"note: {other} is the same source as {src} (stored as {storage_key(src)}); it is stored separately "
                "because KServe keys a model by the URI's exact text: use one spelling to keep one copy"
                in proc.stderr), proc.stderr
    proc = run_cli("pull", str(model(tmp_path / "m2")), "--root", str(root), "--progress", "none")
    assert "note:" not in proc.stderr
