"""A finished init container leaves DEST holding exactly the model's files (runtimes such as Triton
take every sub-directory of their model repository for a model, dot-directories included), and a
rerun still finds the model there without downloading it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from initializer import finished
from modelcache.sources.uri import storage_key
from tests.archive_util import make_tar, tar_file
from tests.fixtures.http import NginxServer, random_bytes
from tests.initializer_util import run_initializer


def _tree(dest: Path) -> list[str]:
    return sorted(str(p.relative_to(dest)) for p in dest.rglob("*"))


def _model_bytes(nginx: NginxServer, rel: str) -> int:
    """Body bytes beyond the listing's one-byte range probe."""
    return sum(e.bytes_sent for e in nginx.requests_for(rel) if e.range != "bytes=0-0")


def test_a_finished_dest_holds_exactly_the_model(nginx: NginxServer, moto_s3, tmp_path: Path) -> None:
    bucket = moto_s3.new_bucket()
    for rel in ("config.json", "1/model.plan", "tokenizer/vocab.txt"):
        moto_s3.client().put_object(Bucket=bucket, Key=f"m/{rel}", Body=os.urandom(1000))
    nginx.write("w/model.bin", 1 << 20)
    make_tar(nginx.docroot / "a/model.tar.gz", [tar_file("1/model.onnx", random_bytes(5000))], "w:gz")
    os.chmod(nginx.docroot / "a/model.tar.gz", 0o644)
    r = run_initializer(f"s3://{bucket}/m", tmp_path / "s3", nginx.url("w/model.bin"), tmp_path / "http",
                        nginx.url("a/model.tar.gz"), tmp_path / "tar", env=moto_s3.env())
    assert r.code == 0, r.output
    assert _tree(tmp_path / "s3") == ["1", "1/model.plan", "config.json", "tokenizer", "tokenizer/vocab.txt"]
    assert _tree(tmp_path / "http") == ["model.bin"]
    assert _tree(tmp_path / "tar") == ["1", "1/model.onnx"]


def test_a_rerun_finds_the_model_without_a_request(nginx: NginxServer, tmp_path: Path) -> None:
    make_tar(nginx.docroot / "a/model.tar.gz", [tar_file("1/model.onnx", random_bytes(5000))], "w:gz")
    os.chmod(nginx.docroot / "a/model.tar.gz", 0o644)
    dest = tmp_path / "d"
    assert run_initializer(nginx.url("a/model.tar.gz"), dest).code == 0
    # Where DEST's completeness is kept: an extended attribute, not a file a runtime could load.
    assert finished.load(dest, storage_key(nginx.url("a/model.tar.gz"))) is not None
    nginx.clear_access_log()
    r = run_initializer(nginx.url("a/model.tar.gz"), dest)
    assert r.code == 0, r.output
    time.sleep(0.2)  # nginx logs a request when it ends
    assert nginx.access_log() == [] and "cached:" in r.out
    assert _tree(dest) == ["1", "1/model.onnx"]


def test_without_the_record_a_rerun_adopts_dest_with_no_download(nginx: NginxServer, tmp_path: Path) -> None:
    """A file system without user xattrs (tmpfs before Linux 6.6), or DEST copied without them: the
    rerun lists the source and checks DEST against it; nothing of the model is fetched again."""
    nginx.write("w/model.bin", 4 << 20)
    uri = nginx.url("w/model.bin")
    dest = tmp_path / "d"
    assert run_initializer(uri, dest).code == 0
    finished.forget(dest, storage_key(uri))
    nginx.clear_access_log()
    r = run_initializer(uri, dest)
    assert r.code == 0, r.output
    assert _model_bytes(nginx, "w/model.bin") == 0
    assert _tree(dest) == ["model.bin"] and finished.load(dest, storage_key(uri)) is not None


# ---- a rerun checks what its record vouches for (issue 33, F4) -----------------------------------


def _pinned(nginx: NginxServer, size: int) -> tuple[str, bytes]:
    import hashlib

    nginx.write("p/model.bin", size)
    data = (nginx.docroot / "p" / "model.bin").read_bytes()
    return nginx.url("p/model.bin") + "#sha256=" + hashlib.sha256(data).hexdigest(), data


def _rerun_restores(nginx: NginxServer, uri: str, dest: Path, data: bytes) -> None:
    nginx.clear_access_log()
    r = run_initializer(uri, dest)
    assert r.code == 0, r.output
    assert (dest / "model.bin").read_bytes() == data and _tree(dest) == ["model.bin"]
    assert _model_bytes(nginx, "p/model.bin") == len(data), "the file was not fetched again"


def test_f4_a_pinned_rerun_hashes_the_file_and_fetches_a_same_size_change_again(
        nginx: NginxServer, tmp_path: Path) -> None:
    """F4: DEST/model.bin with one byte flipped (same size) and the record xattr there: the rerun
    said "1/1 pairs ok ... 0 B transferred" and the wrong bytes stayed, the URI's pin unused."""
    uri, data = _pinned(nginx, 3 << 20)
    dest = tmp_path / "d"
    assert run_initializer(uri, dest).code == 0
    assert finished.load(dest, storage_key(uri)) is not None
    with open(dest / "model.bin", "r+b") as f:  # between the fingerprint's samples: only the pin sees it
        f.seek(200_000)
        f.write(bytes([data[200_000] ^ 1]))
    _rerun_restores(nginx, uri, dest, data)


def test_f4_a_zero_filled_file_of_the_right_size_is_fetched_again(nginx: NginxServer, tmp_path: Path) -> None:
    """F4: ``truncate -s`` to the right size (what a preallocating or cut copy leaves) was kept."""
    uri, data = _pinned(nginx, 3 << 20)
    dest = tmp_path / "d"
    assert run_initializer(uri, dest).code == 0
    (dest / "model.bin").unlink()
    os.truncate(os.open(dest / "model.bin", os.O_CREAT | os.O_WRONLY, 0o644), len(data))
    _rerun_restores(nginx, uri, dest, data)


@pytest.mark.parametrize("damage", ["written-zeros", "cut-copy", "first-byte"])
def test_f4_without_a_pin_the_fingerprint_catches_zeros_and_cut_copies(
        nginx: NginxServer, tmp_path: Path, damage: str) -> None:
    """No pin, no xattr-less fallback: the record's sampled fingerprint (1 MiB read per file)."""
    uri, data = _pinned(nginx, 3 << 20)
    uri = uri.partition("#")[0]
    dest = tmp_path / "d"
    assert run_initializer(uri, dest).code == 0
    if damage == "written-zeros":  # real zeros, no holes: sizes and SEEK_HOLE cannot tell
        (dest / "model.bin").write_bytes(bytes(len(data)))
    elif damage == "cut-copy":  # the first 2 MiB right, the rest zeros
        (dest / "model.bin").write_bytes(data[: 2 << 20] + bytes(len(data) - (2 << 20)))
    else:
        (dest / "model.bin").write_bytes(bytes([data[0] ^ 1]) + data[1:])
    _rerun_restores(nginx, uri, dest, data)


def test_f4_an_intact_pinned_rerun_still_makes_no_request(nginx: NginxServer, tmp_path: Path) -> None:
    uri, _data = _pinned(nginx, 3 << 20)
    dest = tmp_path / "d"
    assert run_initializer(uri, dest).code == 0
    nginx.clear_access_log()
    r = run_initializer(uri, dest)
    assert r.code == 0 and "cached:" in r.out, r.output
    time.sleep(0.2)  # nginx logs a request when it ends
    assert nginx.access_log() == []
