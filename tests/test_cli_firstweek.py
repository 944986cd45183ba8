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
from typing import Any

import pytest

from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.fixtures.http import NginxServer
from tests.helpers import REPO, mounted_tmpfs
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
        verify = run_cli("verify", "--root", str(small))
        assert verify.returncode == 0 and verify.stdout.splitlines() == [
            "kserve-cached-abc: not made by modelcache: nothing to verify it against (skipped)",
            f"no models in {small}"], verify.stdout
        listed = json.loads(run_cli("ls", "--root", str(small), "--json").stdout)
        assert [(e["storage_key"], e["made"], e["size"], e["state"]) for e in listed] == [
            ("kserve-cached-abc", False, 100 * MiB, "not modelcache's")]

        pull = run_cli("pull", uri, "--root", str(small), "--progress", "none")
        assert pull.returncode == 1
        (line,) = errors(pull.stderr)
        assert re.fullmatch(
            rf"error: {re.escape(uri)}: insufficient space at {re.escape(str(small))}: need 200\.0 MiB plus a "
            r"64\.0 MiB margin kept free, [\d.]+ MiB free; no model of this store can be evicted to make room: free "
            rf"space on the file system by other means; 1 folder\(s\) under {re.escape(str(small))}/models, not made "
            rf"by modelcache, hold 100\.0 MiB \(`modelcache ls --root {re.escape(str(small))}` names them; only "
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


def test_ctrl_c_against_a_server_that_ignores_range_promises_no_resume(nginx: NginxServer, tmp_path: Path) -> None:
    """C1: interrupting a pull from a server that ignores Range (``python3 -m http.server``; here
    nginx with ``max_ranges 0``) said "X MiB are staged ... run the same command again to resume",
    and the rerun started at 1.9%; the explanation was an info line the CLI hides."""
    from modelcache.pull import staged_pulls
    from tests.helpers import wait_until
    from tests.pull_helpers import popen_cli

    nginx.write("norange/w.bin", 24 * MiB, seed=4)
    nginx.set_limit_rate("norange", 2 * MiB)
    uri, root = nginx.url("norange/w.bin", listener="norange"), tmp_path / "root"
    proc = popen_cli("pull", uri, "--root", str(root), "--progress", "plain", "--progress-interval", "0.3")
    wait_until(lambda: any(s.files for s in staged_pulls(NodeStore.at(root))), timeout=30, what="the pull started")
    import time

    time.sleep(3)  # ~6 MiB arrive
    import signal

    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    # Said at the start, where the CLI shows it (a warning, not a hidden info line).
    warn = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert warn and "the server ignores Range (HTTP 200 to a ranged request)" in warn[0] and \
        "an interrupted download of its 24.0 MiB starts over from byte 0" in warn[0], err
    (line,) = errors(err)
    m = re.fullmatch(r"error: interrupted: nothing can be resumed: the server ignores Range requests, so the next run "
                     r"downloads the ([\d.]+) MiB that arrived again from byte 0 \(a server that honours Range "
                     r"resumes\)", line)
    assert m and float(m.group(1)) >= 1, line
    # Nothing of it is kept to promise a resume from: ls said "interrupted 0%" and its footer
    # "interrupted pulls resume where they stopped".
    ls = run_cli("ls", "--root", str(root))
    assert ls.stdout.strip() == f"no models in {root}" and "resume" not in ls.stderr, ls.stdout + ls.stderr
    assert not (root / ".modelcache" / "staging" / storage_key(uri)).exists()


def test_verify_of_a_mistyped_key_says_not_stored_not_damaged(tmp_path: Path) -> None:
    """W2: `verify` of a key one character off reported damage and advised `verify --repair`,
    which advised a `pull` of a key, without --root."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(100_000))
    root = tmp_path / "root"
    assert run_cli("pull", str(src), "--root", str(root), "--progress", "none").returncode == 0
    key = storage_key(str(src))
    typo = key[:-1] + ("0" if key[-1] != "0" else "1")
    want = (f"error: {typo}: not in the store at {root} (nothing was pulled from this exact URI or key; "
            "`modelcache ls` lists what is there)")
    for args in (["verify"], ["verify", "--repair"]):
        proc = run_cli(*args, "--root", str(root), typo)
        assert proc.returncode == 1
        assert errors(proc.stderr) == [want], proc.stderr
        assert "damage" not in proc.stdout + proc.stderr and "repair" not in proc.stderr
    proc = run_cli("verify", "--repair", "--root", str(root), "nonexistentkey")
    assert proc.returncode == 1 and errors(proc.stderr) == [want.replace(typo, "nonexistentkey")]
    # The real key alongside a typo: the real one is verified, the typo named, exit 1.
    proc = run_cli("verify", "--root", str(root), key, typo)
    assert proc.returncode == 1 and f"{key}: ok" in proc.stdout and errors(proc.stderr) == [want]


def test_a_401_hint_shows_commands_a_shell_can_run(nginx: NginxServer, tmp_path: Path) -> None:
    """C7: the hint named an environment variable ('127.0.0.1-headers') that `export` refuses."""
    nginx.write("m/config.json", b"{}")
    uri = nginx.url("auth/m/config.json")
    proc = run_cli("pull", uri, "--root", str(tmp_path / "root"), "--progress", "none")
    (line,) = errors(proc.stderr)
    assert ("HTTP 401 Unauthorized: send credentials: put USER:PASSWORD@ before the host in the URI (sent as basic "
            "auth), or set request headers in the variable '127.0.0.1-headers' (JSON; a shell cannot export that "
            "name: env '127.0.0.1-headers={\"Authorization\": \"Bearer ...\"}' modelcache pull ...)") in line, line
    # The `env` form the hint shows works as written.
    name, value = nginx.auth_header
    ok = run_cli("pull", uri, "--root", str(tmp_path / "root"), "--progress", "none",
                 env={"127.0.0.1-headers": json.dumps({name: value})})
    assert ok.returncode == 0, ok.stderr


def test_an_endpoint_without_a_scheme_names_the_variable_and_the_fix(tmp_path: Path) -> None:
    """C8: `AWS_ENDPOINT_URL=127.0.0.1:18090` gave `ValueError('Invalid endpoint: 127.0.0.1:18090')`."""
    env = {"AWS_ENDPOINT_URL": "127.0.0.1:18090", "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}
    proc = run_cli("pull", "s3://models/llm2", "--root", str(tmp_path / "root"), "--progress", "none", env=env)
    assert proc.returncode == 1
    assert errors(proc.stderr) == [
        "error: s3://models/llm2: the S3 endpoint '127.0.0.1:18090' (AWS_ENDPOINT_URL, or the storage spec's "
        "endpoint_url) has no scheme: write it as http://127.0.0.1:18090 or https://127.0.0.1:18090"], proc.stderr


def test_a_wrong_pin_is_named_as_the_likely_cause_and_shown_whole(nginx: NginxServer, tmp_path: Path) -> None:
    """C9: a `#sha256=` pin set to another file's digest: two log lines in another format, then an
    error blaming the source, with the pin redacted and the ':' after the URI swallowed."""
    import hashlib

    nginx.write("tok/extra.json", b'{"extra": true}')
    other = hashlib.sha256(b"another file").hexdigest()
    uri = nginx.url("tok/extra.json") + "#sha256=" + other
    proc = run_cli("pull", uri, "--root", str(tmp_path / "root"), "--progress", "none")
    assert proc.returncode == 1
    warns = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]
    assert [w.split(" (expected")[0] for w in warns] == [
        f"warning: extra.json: sha256 mismatch on attempt {n} of 3" for n in (1, 2)]
    (line,) = errors(proc.stderr)
    got = hashlib.sha256(b'{"extra": true}').hexdigest()
    assert line == (f"error: {uri}: extra.json: sha256 mismatch after 3 attempts: expected {other}, got {got}; the "
                    "file does not match the #sha256= pin written in the URI (the server sent the same bytes every "
                    "time): check the digest in the URI"), line
    assert "<redacted>" not in proc.stderr and "Traceback" not in proc.stderr
    short = nginx.url("tok/extra.json") + "#sha256=abc"
    bad = run_cli("pull", short, "--root", str(tmp_path / "root"))
    (line,) = errors(bad.stderr)
    assert line.startswith(f"error: invalid storage URI '{short}': the fragment "), line


def test_root_defaults_and_hints_name_the_root(tmp_path: Path) -> None:
    """C12: a pull without --root filled /mnt/models silently; the ls footer's command had no --root."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"x" * 1000)
    env = {k: v for k, v in os.environ.items() if k != "MODELCACHE_ROOT"}
    import subprocess

    from tests.pull_helpers import cli_cmd

    # Without --root (and no MODELCACHE_ROOT) the pull says where it goes. Run with --dest's twin:
    # an unwritable default is not touched here, so the note is checked on a URI that fails first.
    proc = subprocess.run([*cli_cmd(), "pull", "s3://", "--progress", "none"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert "note: no --root given (nor MODELCACHE_ROOT): pulling into the default store /mnt/models" in proc.stderr
    proc = run_cli("pull", str(src), "--root", str(tmp_path / "r"), "--progress", "none")
    assert "note: no --root" not in proc.stderr


def test_log_level_works_after_the_sub_command_and_looks_like_the_other_lines(tmp_path: Path) -> None:
    """C14: `modelcache pull --log-level info` was "No such option"; logs were in a second format."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"x" * 1000)
    import tarfile

    with tarfile.open(tmp_path / "m.tar", "w") as tar:  # a pull that logs at info: its archive unpacked
        tar.add(src / "w.bin", arcname="w.bin")
    for n, args in enumerate((["--log-level", "debug", "pull"], ["pull", "--log-level", "debug"])):
        proc = run_cli(*args, str(tmp_path / "m.tar"), "--root", str(tmp_path / f"root{n}"), "--progress", "none")
        assert proc.returncode == 0, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if re.match(r"\d{4}-\d\d-\d\dT", ln)]
        assert lines and all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (debug|info) ", ln) for ln in lines), \
            proc.stderr
        assert any("info modelcache.pull: " in ln and "unpacked m.tar (1 file)" in ln for ln in lines), proc.stderr
        assert not re.search(r"\d\d:\d\d:\d\d,\d{3} ", proc.stderr)  # Python's default format
    help_ = run_cli("pull", "--help")
    assert "--log-level" in help_.stdout


def test_cosmetic_points_of_the_cli(nginx: NginxServer, tmp_path: Path) -> None:
    """The review's cosmetic points, each as the user sees it."""
    root = tmp_path / "root"
    nginx.write("c/a.bin", 1 * MiB, seed=1)
    nginx.write("slowc/b.bin", 6 * MiB, seed=2)
    nginx.set_limit_rate("slowc", 2 * MiB)
    a, b = nginx.url("c/a.bin"), nginx.url("slowc/b.bin")
    proc = run_cli("pull", a, b, "--root", str(root), "--progress", "none")
    assert proc.returncode == 0, proc.stderr
    # "1 file", and each model's own time in a batch (a: well before b's ~3 s).
    line_a = next(ln for ln in proc.stderr.splitlines() if ln.startswith(a))
    line_b = next(ln for ln in proc.stderr.splitlines() if ln.startswith(b))
    assert "(1 file, 1.0 MiB, in " in line_a and "(1 file, 6.0 MiB, in " in line_b
    ta, tb = (float(re.search(r"in ([\d.]+)s", ln).group(1)) for ln in (line_a, line_b))  # type: ignore[union-attr]
    assert ta < tb - 1, (line_a, line_b)
    # ls --json: every time in RFC 3339.
    listed = json.loads(run_cli("ls", "--root", str(root), "--json").stdout)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", e["last_used"]) and
               re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", e["created_at"]) for e in listed), listed
    # rm --json: a list of objects, as every other --json output.
    rm = json.loads(run_cli("rm", a, "--root", str(root), "--json").stdout)
    assert rm == [{"model": a, "storage_key": storage_key(a), "removed": True, "made_by_modelcache": True}]
    # A usage error points at the sub-command's help.
    proc = run_cli("gc", "--root", str(root), "--targetfree", "1G")
    assert proc.returncode == 2 and errors(proc.stderr) == [
        "error: No such option '--targetfree'. Did you mean '--target-free'? (see modelcache gc --help)"]
    # An invalid URI of a known scheme names its own form, not all of them.
    proc = run_cli("pull", "hf://org", "--root", str(root))
    (line,) = errors(proc.stderr)
    assert line == "error: invalid storage URI 'hf://org': expected hf://owner/model[:revision][/sub/dir]", line
    # --dest holds one model: a usage error (exit 2), before anything is done.
    proc = run_cli("pull", a, b, "--dest", str(tmp_path / "d"))
    assert proc.returncode == 2 and "--dest holds one model, 2 URIs were given" in proc.stderr
    assert not (tmp_path / "d").exists()
    # --dest leaves the model and nothing else; a second pull checks the files (no download).
    dest = tmp_path / "dest"
    assert run_cli("pull", a, "--dest", str(dest), "--progress", "none").returncode == 0
    assert sorted(p.name for p in dest.iterdir()) == ["a.bin"]
    nginx.clear_access_log()
    again = run_cli("pull", a, "--dest", str(dest), "--progress", "none")
    assert again.returncode == 0 and nginx.bytes_served("c/a.bin") <= 1, again.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["a.bin"]
    # "no AWS credentials" starts with the URI, as every other error.
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
           "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    proc = run_cli("pull", "s3://bucket/m", "--root", str(root), "--progress", "none", env=env)
    (line,) = errors(proc.stderr)
    assert line.startswith("error: s3://bucket/m: no AWS credentials: set AWS_ACCESS_KEY_ID"), line


def test_lock_files_go_with_their_models(nginx: NginxServer, tmp_path: Path) -> None:
    """The race review's finding 5 (exp4): after models a, b, d and e were deleted, locks/ still
    held a lock file for all five keys."""
    root = tmp_path / "root"
    uris = {}
    for n in "abcde":
        nginx.write(f"l/{n}.bin", 100_000, seed=ord(n))
        uris[n] = nginx.url(f"l/{n}.bin")
    assert run_cli("pull", *uris.values(), "--root", str(root), "--progress", "none").returncode == 0
    assert run_cli("rm", uris["a"], uris["b"], "--root", str(root)).returncode == 0
    assert run_cli("gc", "--root", str(root), "--target-free", "1P", "--evict-all", "--dry-run").returncode == 0
    for n in "de":
        assert run_cli("rm", uris[n], "--root", str(root)).returncode == 0
    assert sorted(p.name for p in (root / ".modelcache" / "locks").iterdir()) == [f"{storage_key(uris['c'])}.lock"]
    # A lock unlinked while another process waited on it: the waiter locks the file that is there now.
    store = NodeStore.at(root)
    key = storage_key(uris["c"])
    with store.lock(key):
        pass
    assert (root / ".modelcache" / "locks" / f"{key}.lock").exists()  # the model is there: its lock stays


def test_bars_show_binary_rates_and_no_eta_from_the_first_moments() -> None:
    """Cosmetic: the bars said MB/s where the plain lines said MiB/s; the agent's first progress
    line said "eta 2110h54m28s" from its first few kilobytes."""
    import io

    from modelcache.cli.display import show_progress
    from modelcache.runtime.progress import ProgressSnapshot, ProgressTracker, format_line

    tracker = ProgressTracker()
    tracker.add_total(100 * MiB, 1)
    tracker.file_started("w.bin", 100 * MiB)
    tracker.advance("w.bin", 4096)
    assert format_line(tracker.snapshot()).endswith("eta ?")
    later = ProgressSnapshot(bytes_done=50 * MiB, bytes_total=100 * MiB, files_done=0, files_total=1,
                             rate=10 * MiB, elapsed=5.0)
    assert format_line(later).endswith("10.0 MiB/s eta 5s")
    out = io.StringIO()
    with show_progress(tracker, "bar", stream=out):
        tracker.advance("w.bin", 8 * MiB)
        import time

        time.sleep(0.5)
    text = out.getvalue()
    assert "MiB/s" in text or "KiB/s" in text or "?" in text
    assert not re.search(r"\d MB/s", text), text


def test_a_stored_model_is_answered_by_its_uri_text_whatever_the_endpoint(moto_s3: Any, tmp_path: Path) -> None:
    """C16, kept on purpose and documented: `s3://models/llm` pulled from one endpoint is answered
    `cached` when AWS_ENDPOINT_URL names another server (KServe keys a model by the URI's text);
    `pull --check` is what compares with a source, and without the source's keys and endpoint in
    its environment it says so (C11: the drift row of install.md now names them)."""
    bucket = moto_s3.new_bucket()
    moto_s3.client().put_object(Bucket=bucket, Key="llm/w.bin", Body=b"w" * 1000)
    uri, root = f"s3://{bucket}/llm", tmp_path / "root"
    assert run_cli("pull", uri, "--root", str(root), "--progress", "none", env=moto_s3.env()).returncode == 0
    elsewhere = {**moto_s3.env(), "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}  # nothing listens there
    proc = run_cli("pull", uri, "--root", str(root), "--progress", "none", env=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\(1 file, 1000 B, cached[,)]", proc.stderr.splitlines()[-1]), proc.stderr
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "stored model is answered from the store by its URI's text alone, as KServe keys it" in readme
    # On a node the CLI reads its own environment, not the cluster's Secret: it says what is missing.
    bare = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_ACCESS_KEY_ID": "",
            "AWS_SECRET_ACCESS_KEY": "", "AWS_ENDPOINT_URL": moto_s3.endpoint}
    check = run_cli("pull", "--check", "--root", str(root), env=bare)
    assert check.returncode == 1
    assert re.search(rf"^{storage_key(uri)}\s+error\s+{re.escape(uri)}: no AWS credentials: set AWS_ACCESS_KEY_ID",
                     check.stdout, re.M), check.stdout
    install = " ".join((REPO / "docs" / "install.md").read_text().split())
    assert "The CLI reads credentials and endpoints from its own environment, not from the cluster" in install


def test_a_refused_repair_of_an_http_model_leaves_no_damaged_bytes_published(
        nginx: NginxServer, tmp_path: Path) -> None:
    """W1, the review's steps: an HTTP file without a checksum (`{"version": "one", ...}`) pulled;
    the source changed to `"two"` (same size) and one byte of the stored copy damaged; `verify
    --repair` refused (the source changed). The model had lost its manifest (`ls`: `incomplete 0 B`),
    the next plain pull adopted the damaged file on its size, and `verify` and `pull --check` then
    called it fine; a `.modelcache/repair/KEY.pinned.json` stayed behind."""
    one, two = b'{"version": "one", "pad": 1234}', b'{"version": "two", "pad": 1234}'
    nginx.write("llm/gen.json", one)
    uri, root = nginx.url("llm/gen.json"), tmp_path / "root"
    key = storage_key(uri)
    assert run_cli("pull", "--root", str(root), uri, "--progress", "none").returncode == 0
    stored = root / "models" / key / "gen.json"
    served = nginx.docroot / "llm" / "gen.json"
    served.write_bytes(two)
    later = served.stat().st_mtime + 10  # a Last-Modified of its own (HTTP dates have 1 s steps)
    os.utime(served, (later, later))
    stored.write_bytes(b'{"Xersion"' + one[len(b'{"Xersion"'):])
    repair = run_cli("verify", "--repair", "--root", str(root), key)
    assert repair.returncode == 1
    line, last = errors(repair.stderr)
    assert last == "error: 1 of 1 damaged model(s) not repaired"
    assert line.startswith(f"error: {key}: {uri}: the source changed since the model was downloaded"), line
    assert f"{key}: kept as it is, marked damaged (not present); `modelcache pull --root {root} {uri}`" in repair.stderr
    assert not list((root / ".modelcache").glob("repair/*")), "a repair record stayed behind"
    ls = run_cli("ls", "--root", str(root))
    assert re.search(rf"^{key}\s+damaged\s+31 B\s+1\s+{re.escape(uri)}$", ls.stdout, re.M), ls.stdout
    assert "incomplete" not in ls.stdout
    assert run_cli("verify", "--root", str(root), key).returncode == 1
    again = run_cli("pull", "--root", str(root), uri, "--progress", "none")
    assert again.returncode == 0, again.stderr
    assert "cached" not in again.stderr.splitlines()[-1], again.stderr
    assert stored.read_bytes() == two  # the source's current bytes, not the damaged old ones
    verify = run_cli("verify", "--root", str(root))
    assert verify.returncode == 0 and f"{key}: ok" in verify.stdout, verify.stdout + verify.stderr
    check = run_cli("pull", "--check", "--root", str(root))
    assert check.returncode == 0 and re.search(rf"^{key}\s+current\b", check.stdout, re.M), check.stdout
    assert not list((root / ".modelcache").glob("repair/*"))
