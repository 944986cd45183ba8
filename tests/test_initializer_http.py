"""storage-initializer as a subprocess against a real nginx: pulls, archives, resume after
kill -9, no traffic for a complete DEST, CA bundle, and no secret in any output."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from tests.archive_util import crc_damaged_targz, make_tar, make_zip, tar_entry, tar_file, zip_special
from tests.fixtures.http import NginxServer, random_bytes
from tests.helpers import REPO
from tests.initializer_util import initializer_cmd, initializer_env, run_initializer


def _visible(dest: Path) -> list[str]:
    """What the serving runtime sees: everything in DEST (a finished pair leaves no bookkeeping)."""
    return sorted(p.name for p in dest.iterdir())


def _no_staging_left(dest: Path) -> None:
    assert not [p for p in dest.iterdir() if p.name.startswith(".modelcache-unpack-")]
    assert not (dest / ".modelcache" / "staging").exists()


def test_multiple_pairs_http_https_and_local(nginx: NginxServer, tmp_path: Path) -> None:
    nginx.write("m1/model.bin", 3 << 20)
    nginx.write("m2/config.json", b'{"arch": "x"}')  # served as application/json: fine for us
    local = tmp_path / "local-model"
    local.mkdir()
    (local / "tok.txt").write_text("tok")
    out = tmp_path / "out"
    env = {"CA_BUNDLE_CONFIGMAP_NAME": "ca", "CA_BUNDLE_VOLUME_MOUNT_POINT": str(tmp_path / "ca")}
    (tmp_path / "ca").mkdir()
    (tmp_path / "ca" / "cabundle.crt").write_bytes(nginx.ca_path.read_bytes())
    r = run_initializer(
        nginx.url("m1/model.bin"), out / "a",
        nginx.url("m2/config.json", "https"), out / "b",
        local, out / "c",
        env=env,
    )
    assert r.code == 0, r.output
    assert (out / "a" / "model.bin").read_bytes() == (nginx.docroot / "m1/model.bin").read_bytes()
    assert (out / "b" / "config.json").read_bytes() == b'{"arch": "x"}'
    assert (out / "c" / "tok.txt").read_text() == "tok"
    assert _visible(out / "a") == ["model.bin"]
    assert r.err == ""
    last = r.out.strip().splitlines()[-1]
    assert last.startswith("done: 3/3 pairs ok")


def test_https_without_the_ca_bundle_fails_clearly(nginx: NginxServer, tmp_path: Path) -> None:
    nginx.write("m/model.bin", 1000)
    r = run_initializer(nginx.url("m/model.bin", "https"), tmp_path / "d")
    assert r.code == 1
    (line,) = [x for x in r.err.splitlines() if x.startswith("error:")]
    assert nginx.url("m/model.bin", "https") in line and re.search(r"(?i)certificate|ssl|tls", line)


def test_complete_dest_makes_no_request(nginx: NginxServer, tmp_path: Path) -> None:
    nginx.write("m/model.bin", 2 << 20)
    make_tar(nginx.docroot / "a/model.tar.gz", [tar_file("w/x.bin", random_bytes(50_000))], "w:gz")
    os.chmod(nginx.docroot / "a/model.tar.gz", 0o644)
    args = [nginx.url("m/model.bin"), tmp_path / "d1", nginx.url("a/model.tar.gz"), tmp_path / "d2"]
    r = run_initializer(*args)
    assert r.code == 0, r.output
    assert nginx.access_log(), "the first run must have fetched"
    assert _visible(tmp_path / "d2") == ["w"]
    nginx.clear_access_log()
    r = run_initializer(*args)
    assert r.code == 0, r.output
    time.sleep(0.2)  # nginx logs a request when it ends; give a stray one time to show up
    assert nginx.access_log() == []
    assert r.out.count("cached:") == 2
    # A file the runtime deleted makes the DEST incomplete: it is fetched again.
    (tmp_path / "d1" / "model.bin").unlink()
    r = run_initializer(*args)
    assert r.code == 0, r.output
    # The whole file again (plus at most a tiny probe request), and nothing of the archive.
    assert 2 << 20 <= nginx.bytes_served("m/model.bin") <= (2 << 20) + 4096
    assert nginx.requests_for("a/model.tar.gz") == []


def test_partial_dest_after_kill9_resumes(nginx: NginxServer, tmp_path: Path) -> None:
    size = 12 << 20
    nginx.write("slow/model.bin", size)
    nginx.set_limit_rate("slow", 2 << 20)
    dest = tmp_path / "d"
    knobs = {"MODELCACHE_WORKERS": "1", "MODELCACHE_CHUNK_SIZE": "16M"}
    env = initializer_env(knobs)
    proc = subprocess.Popen(
        [*initializer_cmd(), nginx.url("slow/model.bin"), str(dest)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen += line
            m = re.match(r"progress: +[\d.]+% ([\d.]+) MiB/", line)
            if m and float(m.group(1)) >= 6:
                break
            assert line, f"initializer ended before making progress: {seen}"
        else:
            pytest.fail(f"no progress line reached 6 MiB: {seen}")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert not (dest / "model.bin").exists()  # nothing half-written where the runtime looks
    nginx.set_limit_rate("slow", 1 << 30)
    nginx.clear_access_log()
    r = run_initializer(nginx.url("slow/model.bin"), dest, env=knobs)
    assert r.code == 0, r.output
    assert (dest / "model.bin").read_bytes() == (nginx.docroot / "slow/model.bin").read_bytes()
    served = nginx.bytes_served("slow/model.bin")
    # At least one 4 MiB piece was journaled before the kill and is not fetched again.
    assert 0 < served <= size - (4 << 20) + 4096, f"resumed run fetched {served} of {size} bytes"
    _no_staging_left(dest)


# -- archives ---------------------------------------------------------------------------------


def _serve(nginx: NginxServer, rel: str) -> str:
    os.chmod(nginx.docroot / rel, 0o644)
    return nginx.url(rel)


def test_good_archives_are_unpacked(nginx: NginxServer, tmp_path: Path) -> None:
    make_tar(
        nginx.docroot / "t/model.tgz",
        [
            tar_entry("model", tarfile.DIRTYPE),
            tar_file("model/w.bin", random_bytes(100_000)),
            tar_entry("model/latest", tarfile.SYMTYPE, "w.bin"),
            tar_entry("model/w2.bin", tarfile.LNKTYPE, "model/w.bin"),
        ],
        "w:gz",
    )
    make_zip(nginx.docroot / "z/model.zip", [("cfg/config.json", b"{}"), ("cfg/vocab.txt", b"a b c")])
    make_tar(nginx.docroot / "p/plain.tar", [tar_file("x.txt", b"x")])
    out = tmp_path / "out"
    r = run_initializer(
        _serve(nginx, "t/model.tgz"), out / "t", _serve(nginx, "z/model.zip"), out / "z",
        _serve(nginx, "p/plain.tar"), out / "p",
    )
    assert r.code == 0, r.output
    assert _visible(out / "t") == ["model"]
    assert (out / "t/model/latest").read_bytes() == random_bytes(100_000)
    assert os.stat(out / "t/model/w2.bin").st_ino == os.stat(out / "t/model/w.bin").st_ino
    assert _visible(out / "z") == ["cfg"] and (out / "z/cfg/vocab.txt").read_text() == "a b c"
    assert _visible(out / "p") == ["x.txt"]
    for d in ("t", "z", "p"):
        _no_staging_left(out / d)
    assert "unpacked model.tgz (2 files)" in r.out  # w.bin and its hardlink; the symlink apart


def test_archives_kserve_unpacks_by_a_query_or_an_old_suffix_are_unpacked(nginx: NginxServer, tmp_path: Path) -> None:
    """KServe v0.20.0 takes an archive's type from the query when the URL path has none
    (`https://h/download?file=model.tar.gz`) and knows `.taz`/`.tz` as gzip tars (Python's
    mimetypes): it unpacks those, and so does the initializer (audit C23, C30). A path with a type
    of its own keeps it (`model.bin?x=y.tar` is a file)."""
    make_tar(nginx.docroot / "q/download", [tar_file("cfg/config.json", b"{}"), tar_file("w.bin", b"w" * 1000)],
             "w:gz")
    make_tar(nginx.docroot / "o/model.taz", [tar_file("a.txt", b"a")], "w:gz")
    make_tar(nginx.docroot / "o/model.tz", [tar_file("b.txt", b"b")], "w:gz")
    (nginx.docroot / "f").mkdir()
    (nginx.docroot / "f/model.bin").write_bytes(b"not an archive")
    out = tmp_path / "out"
    r = run_initializer(
        _serve(nginx, "q/download") + "?file=model.tar.gz", out / "q",
        _serve(nginx, "o/model.taz"), out / "taz", _serve(nginx, "o/model.tz"), out / "tz",
        _serve(nginx, "f/model.bin") + "?name=x.tar", out / "f",
    )
    assert r.code == 0, r.output
    assert _visible(out / "q") == ["cfg", "w.bin"] and (out / "q/w.bin").read_bytes() == b"w" * 1000
    assert _visible(out / "taz") == ["a.txt"] and _visible(out / "tz") == ["b.txt"]
    assert _visible(out / "f") == ["model.bin"] and (out / "f/model.bin").read_bytes() == b"not an archive"


HOSTILE = {
    "tar-slip.tar.gz": (lambda p: make_tar(p, [tar_file("../../escaped.txt", b"x")], "w:gz"), "'..'"),
    "zip-slip.zip": (lambda p: make_zip(p, [("ok.txt", b"ok"), ("../../escaped.txt", b"x")]), "'..'"),
    "symlink.tar": (lambda p: make_tar(p, [tar_entry("link", tarfile.SYMTYPE, "../../..")]), "symlink"),
    "symlink.zip": (lambda p: make_zip(p, [(zip_special("l", stat.S_IFLNK | 0o777), b"../..")]), "symlink"),
    "hardlink.tar": (lambda p: make_tar(p, [tar_entry("h", tarfile.LNKTYPE, "../../../etc/passwd")]), "hardlink"),
    "device.tar": (lambda p: make_tar(p, [tar_entry("dev", tarfile.CHRTYPE)]), "device file"),
    "bomb.tar.gz": (lambda p: make_tar(p, [tar_file("zeros.bin", bytes(8 << 20))], "w:gz"), "compression ratio"),
    "bomb.zip": (lambda p: make_zip(p, [("zeros.bin", bytes(8 << 20))]), "compression ratio"),
    "corrupt.tar.gz": (
        lambda p: p.write_bytes(b"\x1f\x8b\x08\x00" + random_bytes(5000)),
        "Failed to unpack archive file. The file format is not valid.",
    ),
    "corrupt.zip": (
        lambda p: p.write_bytes(b"PK\x03\x04" + random_bytes(5000)),
        "Failed to unpack archive file. The file format is not valid.",
    ),
    # Well-formed but one bit off inside the data: only the gzip CRC can tell (was unpacked, exit 0).
    "crc-damaged.tar.gz": (lambda p: crc_damaged_targz(p, random_bytes(300_000)), "CRC check failed"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_and_corrupt_archives_fail_cleanly(nginx: NginxServer, tmp_path: Path, name: str) -> None:
    build, expect = HOSTILE[name]
    (nginx.docroot / "x").mkdir()
    build(nginx.docroot / "x" / name)
    out = tmp_path / "out" / "deep"
    out.mkdir(parents=True)
    r = run_initializer(_serve(nginx, f"x/{name}"), out / "d")
    assert r.code == 1, r.output
    (line,) = [x for x in r.err.splitlines() if x.startswith("error:")]
    assert name in line and expect in line, line
    # Nothing escaped, nothing half-unpacked: DEST holds only the fetched archive.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["deep"]
    assert sorted(p.name for p in out.iterdir()) == ["d"]
    # A failed pair keeps its bookkeeping (a rerun resumes from it); the runtime never starts.
    assert _visible(out / "d") == [".modelcache", name]
    _no_staging_left(out / "d")
    assert r.out.strip().splitlines()[-1].startswith("FAILED: 0/1 pairs ok")


def test_entry_cap_from_env(nginx: NginxServer, tmp_path: Path) -> None:
    make_tar(nginx.docroot / "many.tar", [tar_file(f"f{i}", b"x") for i in range(12)])
    r = run_initializer(_serve(nginx, "many.tar"), tmp_path / "d", env={"MODELCACHE_ARCHIVE_MAX_ENTRIES": "10"})
    assert r.code == 1 and "more than 10 entries" in r.err
    r = run_initializer(_serve(nginx, "many.tar"), tmp_path / "d", env={"MODELCACHE_ARCHIVE_MAX_ENTRIES": "12"})
    assert r.code == 0, r.output
    assert len(_visible(tmp_path / "d")) == 12


# -- errors and secrets ---------------------------------------------------------------------------


def test_http_errors_one_line_per_pair(nginx: NginxServer, tmp_path: Path) -> None:
    nginx.write("ok.bin", 10)
    r = run_initializer(
        nginx.url("status/404/m.bin"), tmp_path / "a", nginx.url("status/403/m.bin"), tmp_path / "b",
        nginx.url("ok.bin"), tmp_path / "c", nginx.url("model.git"), tmp_path / "g",
    )
    assert r.code == 1
    errors = [x for x in r.err.splitlines() if x.startswith("error:")]
    assert len(errors) == 3 and len(r.err.strip().splitlines()) == 3
    assert any("status/404/m.bin" in e for e in errors) and any("status/403/m.bin" in e for e in errors)
    assert any("model.git" in e and "git" in e for e in errors)
    assert (tmp_path / "c" / "ok.bin").exists()


def test_git_like_urls_that_are_files_download(nginx: NginxServer, tmp_path: Path) -> None:
    # KServe's unanchored `https://.+\.git` would try to clone these.
    nginx.write("org.github.io/model.bin", 100)
    nginx.write("x.git/raw/model.onnx", 100)
    r = run_initializer(
        nginx.url("org.github.io/model.bin"), tmp_path / "a", nginx.url("x.git/raw/model.onnx"), tmp_path / "b"
    )
    assert r.code == 0, r.output
    assert (tmp_path / "a/model.bin").exists() and (tmp_path / "b/model.onnx").exists()


def test_no_secret_in_any_output(nginx: NginxServer, tmp_path: Path) -> None:
    nginx.write("m/model.bin", 1 << 20)
    hname, hvalue = nginx.auth_header
    token = "tok-" + "q7Zx" * 6
    secrets = {
        "AWS_SECRET_ACCESS_KEY": "aws-secret-" + "k9" * 10,
        "HF_TOKEN": "hf_" + "s3cr3t" * 4,
        "AZURE_STORAGE_ACCESS_KEY": "azure-key-" + "Zz" * 10,
    }
    env = {
        **secrets,
        # Right token for the auth location: the value is the secret that must never show.
        "127.0.0.1-headers": f'{{"{hname}": "{hvalue}", "Authorization": "Bearer {token}"}}',
        "STORAGE_CONFIG": '{"type": "s3", "access_key_id": "AKIAX", "secret_access_key": "spec-secret-123456"}',
    }
    signed = nginx.url("status/403/m.bin") + "?X-Amz-Signature=deadbeefsig&X-Amz-Credential=credvalue-zz9"
    with_user = nginx.url("m/model.bin").replace("http://", "http://user:hunter2pw@")
    r = run_initializer(
        nginx.url("auth/m/model.bin"), tmp_path / "ok",
        signed, tmp_path / "bad",
        with_user, tmp_path / "user",
        nginx.url("status/401/m.bin"), tmp_path / "unauth",
        env=env,
    )
    assert (tmp_path / "ok" / "model.bin").stat().st_size == 1 << 20
    assert r.code == 1
    for value in [*secrets.values(), hvalue, token, "spec-secret-123456", "deadbeefsig", "hunter2pw", "credvalue-zz9"]:
        assert value not in r.output, f"{value!r} leaked: {r.output}"
    assert "?<redacted>" in r.err


def test_allow_and_ignore_patterns_do_not_filter_a_single_url(nginx: NginxServer, tmp_path: Path) -> None:
    # KServe never applies the patterns to HTTP(S) URIs; neither do we.
    nginx.write("m/model.bin", 100)
    r = run_initializer(
        nginx.url("m/model.bin"), tmp_path / "d",
        env={"STORAGE_ALLOW_PATTERNS": '["*.json"]', "STORAGE_IGNORE_PATTERNS": "*.bin"},
    )
    assert r.code == 0, r.output
    assert (tmp_path / "d" / "model.bin").exists()
