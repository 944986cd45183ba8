"""A finished init container leaves DEST holding exactly the model's files (runtimes such as Triton
take every sub-directory of their model repository for a model, dot-directories included), and a
rerun still finds the model there without downloading it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from initializer import finished
from modelcache.uri import storage_key
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
