"""A user's first week with the CLI (issue 27; the newcomer review's D1, C2, C3, C12 and the
cosmetic points): nothing is deleted that modelcache did not make, space errors suggest only what
can help, a failed pull is not called interrupted, and what the CLI prints says what it means.
Each test follows the review's own steps."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from modelcache.store import NodeStore
from modelcache.uri import storage_key
from tests.fixtures.http import NginxServer
from tests.helpers import mounted_tmpfs
from tests.pull_helpers import MiB, run_cli

pytestmark = pytest.mark.timeout(300)


def errors(stderr: str) -> list[str]:
    assert "Traceback" not in stderr and "Aborted!" not in stderr and "Usage:" not in stderr, stderr
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_folder_modelcache_did_not_make_is_shown_kept_by_gc_and_removed_only_by_name(
        nginx: NginxServer, tmp_path: Path) -> None:
    """D1: a 100 MiB folder under models/ that modelcache never made (a KServe copy, a user's own
    files), then a 200 MiB pull that does not fit and the advice it gives. gc --evict-all used to
    delete the folder as "0 B"; ls showed it "incomplete 0 B"; rm said "not in the store"."""
    with mounted_tmpfs(tmp_path / "small", "size=330m") as small:
        foreign = small / "models" / "kserve-cached-abc"
        foreign.mkdir(parents=True)
        (foreign / "w.bin").write_bytes(os.urandom(100 * MiB))
        nginx.write("big/w.bin", 200 * MiB, seed=7)
        uri = nginx.url("big/w.bin")

        ls = run_cli("ls", "--root", str(small))
        assert ls.returncode == 0, ls.stderr
        assert re.search(r"^kserve-cached-abc\s+not modelcache's\s+100\.0 MiB\s+1\s+\(not made by modelcache\)$",
                         ls.stdout, re.M), ls.stdout
        assert (f"1 folder(s) under {small}/models were not made by modelcache (kserve-cached-abc): gc and the agent "
                f"never delete them; `modelcache rm --root {small} NAME` deletes one") in ls.stderr
        listed = json.loads(run_cli("ls", "--root", str(small), "--json").stdout)
        assert [(e["storage_key"], e["made"], e["size"], e["state"]) for e in listed] == [
            ("kserve-cached-abc", False, 100 * MiB, "not modelcache's")]

        pull = run_cli("pull", uri, "--root", str(small), "--progress", "none")
        assert pull.returncode == 1
        (line,) = errors(pull.stderr)
        assert re.fullmatch(
            rf"error: {re.escape(uri)}: insufficient space at {re.escape(str(small))}: need 200\.0 MiB plus a "
            r"64\.0 MiB margin kept free, [\d.]+ MiB free; no model of this store can be evicted to make room: free "
            rf"space on the file system by other means; 1 folder\(s\) under {re.escape(str(small))}/models not made "
            rf"by modelcache hold 100\.0 MiB \(`modelcache ls --root {re.escape(str(small))}` names them; only "
            r"`modelcache rm` of a name deletes one\)", line), line
        assert "modelcache gc" not in line  # a gc cannot help: nothing of ours to evict
        # A pull refused before it staged a byte leaves nothing behind (C2): no staging, no lock.
        assert not list((small / ".modelcache" / "staging").glob("*"))
        assert not list((small / ".modelcache" / "locks").glob("*"))

        before = used(small)
        gc = run_cli("gc", "--root", str(small), "--target-free", "264M")
        assert gc.returncode == 1
        (line,) = errors(gc.stderr)
        assert "evicting every model not in use (0, 0 B) would make it" in line, line
        gc = run_cli("gc", "--root", str(small), "--target-free", "264M", "--evict-all")
        assert gc.returncode == 0, gc.stderr
        assert "evicted" not in gc.stdout and gc.stdout.startswith("nothing to evict"), gc.stdout
        assert (foreign / "w.bin").stat().st_size == 100 * MiB and used(small) >= before

        rm = run_cli("rm", "kserve-cached-abc", "--root", str(small))
        assert rm.returncode == 0, rm.stderr
        assert rm.stdout.strip() == "kserve-cached-abc: removed (a folder not made by modelcache)"
        assert not foreign.exists() and used(small) < before - 90 * MiB
        assert not list((small / ".modelcache" / "locks").glob("*"))  # no lock left for the name either
        again = run_cli("pull", uri, "--root", str(small), "--progress", "none")
        assert again.returncode == 0, again.stderr


def test_the_space_error_suggests_a_gc_only_when_evicting_makes_the_room(nginx: NginxServer, tmp_path: Path) -> None:
    """C3: on an empty file system too small for the model plus the margin, the error used to
    suggest a gc (of nothing) that could never make the room; the margin was fixed at 64 MiB."""
    with mounted_tmpfs(tmp_path / "fs", "size=340m") as small:
        nginx.write("m/w.bin", os.urandom(300 * MiB))
        uri = nginx.url("m/w.bin")
        pull = run_cli("pull", uri, "--root", str(small), "--progress", "none")
        assert pull.returncode == 1
        (line,) = errors(pull.stderr)
        assert re.fullmatch(
            rf"error: {re.escape(uri)}: insufficient space at {re.escape(str(small))}: need 300\.0 MiB plus a "
            r"64\.0 MiB margin kept free, 340\.0 MiB free; this file system \(340\.0 MiB in all\) is too small for "
            r"the model plus the margin: pull it into a larger one \(--root\), or lower --space-margin", line), line
        assert "gc" not in line
        ok = run_cli("pull", uri, "--root", str(small), "--progress", "none", "--space-margin", "16M")
        assert ok.returncode == 0, ok.stderr
        env = run_cli("pull", uri, "--root", str(small), "--progress", "none",
                      env={"MODELCACHE_SPACE_MARGIN": "1G"})
        assert env.returncode == 0 and "cached" in env.stderr  # a stored model needs no room


def test_space_margin_flag_is_the_one_margin_and_the_gc_it_names_makes_the_room(
        nginx: NginxServer, tmp_path: Path) -> None:
    """With models of ours that a gc can evict, the error names the exact gc (with the margin the
    pull keeps, here --space-margin 8M), and that gc makes exactly the room."""
    with mounted_tmpfs(tmp_path / "fs", "size=100m") as root:
        nginx.write("s/old.bin", 40 * MiB, seed=1)
        nginx.write("s/new.bin", 70 * MiB, seed=2)
        old, new = nginx.url("s/old.bin"), nginx.url("s/new.bin")
        assert run_cli("pull", old, "--root", str(root), "--progress", "none",
                       env={"MODELCACHE_SPACE_MARGIN": "8M"}).returncode == 0
        proc = run_cli("pull", new, "--root", str(root), "--progress", "none", "--space-margin", "8M")
        assert proc.returncode == 1
        (line,) = errors(proc.stderr)
        m = re.fullmatch(rf"error: {re.escape(new)}: insufficient space at {re.escape(str(root))}: need 70\.0 MiB "
                         r"plus a 8\.0 MiB margin kept free, [\d.]+ MiB free; free space, e\.g\. "
                         rf"`(modelcache gc --root {re.escape(str(root))} --target-free 78M)`", line)
        assert m, line
        assert run_cli(*m.group(1).split()[1:]).returncode == 0
        again = run_cli("pull", new, "--root", str(root), "--progress", "none", "--space-margin", "8M")
        assert again.returncode == 0, again.stderr


def test_a_wrong_pin_is_not_listed_as_an_interrupted_pull(nginx: NginxServer, tmp_path: Path) -> None:
    """C2: after a pull whose ``#sha256=`` pin matches no file, ``ls`` showed "interrupted 0%",
    the footer promised a resume, and a staging folder and a lock file stayed until ``rm``."""
    root = tmp_path / "root"
    nginx.write("pin/w.bin", 2 * MiB, seed=3)
    pinned = nginx.url("pin/w.bin") + "#sha256=" + "0" * 64
    pull = run_cli("pull", pinned, "--root", str(root), "--progress", "none")
    assert pull.returncode == 1
    key = storage_key(pinned)
    ls = run_cli("ls", "--root", str(root))
    assert "interrupted" not in ls.stdout + ls.stderr, ls.stdout + ls.stderr
    # Refused bytes are not worth resuming: nothing of that pull is kept.
    assert ls.stdout.strip() == f"no models in {root}", ls.stdout
    assert not (root / ".modelcache" / "staging" / key).exists()
    assert not (root / ".modelcache" / "locks" / f"{key}.lock").exists()


def test_a_failed_pull_that_staged_bytes_says_why_and_how_to_resume(nginx: NginxServer, tmp_path: Path) -> None:
    """C2, the other half: a pull that fails after staging bytes keeps them, and ls says it failed
    and why (not "interrupted"), with the command that resumes it (naming --root, C12)."""
    root = tmp_path / "root"
    nginx.write("gone/b.bin", 6 * MiB, seed=2)
    nginx.set_limit_rate("gone", 1 * MiB)
    from tests.pull_helpers import popen_cli

    uri_b = nginx.url("gone/b.bin")
    proc = popen_cli("pull", uri_b, "--root", str(root), "--progress", "none", "--workers", "1",
                     "--chunk-size", "1M", "--max-attempts", "1")
    from modelcache.pull import staged_pulls
    from tests.helpers import wait_until

    wait_until(lambda: any(s.bytes_done >= 2 * MiB for s in staged_pulls(NodeStore.at(root))), timeout=60,
               what="2 MiB staged")
    shutil.move(str(nginx.docroot / "gone" / "b.bin"), str(tmp_path / "b.bin"))  # the file goes away at the server
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    ls = run_cli("ls", "--root", str(root))
    key = storage_key(uri_b)
    assert re.search(rf"^{key}\s+failed \d+%\s+6\.0 MiB\s+1\s+{re.escape(uri_b)}$", ls.stdout, re.M), ls.stdout
    assert "interrupted" not in ls.stdout + ls.stderr
    r = re.escape(str(root))
    m = re.search(rf"^{key}: failed: NotFound: .*; what it staged is kept: `modelcache pull --root {r} "
                  rf"{re.escape(uri_b)}` resumes once the cause is fixed, `modelcache rm --root {r} {key}` drops it$",
                  ls.stderr, re.M)
    assert m, ls.stderr
    shutil.move(str(tmp_path / "b.bin"), str(nginx.docroot / "gone" / "b.bin"))
    nginx.set_limit_rate("gone", 64 * MiB)
    nginx.clear_access_log()
    again = run_cli("pull", uri_b, "--root", str(root), "--progress", "none", "--chunk-size", "1M")
    assert again.returncode == 0, again.stderr
    assert nginx.bytes_served("gone/b.bin") <= 4 * MiB + 1  # resumed from what the failed pull staged
