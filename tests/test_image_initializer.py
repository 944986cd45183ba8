"""The image as KServe's storage-initializer init container: `storage-initializer URI /mnt/models`
as the image's non-root user into a volume, from nginx and from S3 (moto), files readable by the
serving container's (other) user, and the same exit codes and one-line errors as outside."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

import pytest

from tests.archive_util import make_tar, tar_file
from tests.fixtures.hdfs import SecureHDFS
from tests.fixtures.http import NginxServer
from tests.fixtures.image import Image, emptydir
from tests.fixtures.s3 import S3Server
from tests.initializer_util import run_initializer
from tests.objectstore_data import model_tree

MODELS = "/mnt/models"
#: Not the image's 1000: KServe runtimes run as root, 1000, or an OpenShift random UID.
SERVING_USER = "1234567:0"
PROGRESS = {"MODELCACHE_PROGRESS_INTERVAL": "0.5"}

# Run in the serving container: every file under /mnt/models, its sha256, read as another user.
READ_ALL = """
import hashlib, json, os
out = {}
for d, _, files in os.walk("/mnt/models"):
    for f in files:
        p = os.path.join(d, f)
        out[os.path.relpath(p, "/mnt/models")] = hashlib.sha256(open(p, "rb").read()).hexdigest()
print(json.dumps(out))
"""

# The first test to use `image` also builds it (minutes when the layer cache is cold).
pytestmark = pytest.mark.timeout(900)


def served(image: Image, volume: Path) -> dict[str, str]:
    """What the serving container reads from the volume (read-only, as KServe mounts it)."""
    r = image.run("-c", READ_ALL, entrypoint="python", user=SERVING_USER, mounts=[(volume, MODELS, "ro")])
    assert r.returncode == 0, r.stderr
    return {k: v for k, v in json.loads(r.stdout).items() if not k.startswith(".modelcache")}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def owners(volume: Path) -> set[tuple[int, int]]:
    return {(p.stat().st_uid, p.stat().st_gid) for p in volume.rglob("*") if not p.is_symlink()}


def test_http_pull_into_a_volume_readable_by_the_serving_user(image: Image, nginx: NginxServer,
                                                              tmp_path: Path) -> None:
    weights = nginx.write("m/model.bin", 3 << 20).read_bytes()
    # An archive whose entries are private to their owner (0600 / 0700): what the serving user can
    # read must not depend on the modes an archive was packed with.
    archive = make_tar(nginx.docroot / "bundle.tar.gz", [
        tar_file("cfg/config.json", b'{"arch": "x"}', mode=0o600),
        tar_file("tok/tokenizer.json", os.urandom(5000), mode=0o640),
    ], mode="w:gz")
    with tarfile.open(archive) as tf:
        tokenizer = tf.extractfile("tok/tokenizer.json").read()  # type: ignore[union-attr]
    vol_a, vol_b = emptydir(tmp_path / "a"), emptydir(tmp_path / "b")

    r = image.run(nginx.url("m/model.bin"), MODELS, env=PROGRESS, mounts=[(vol_a, MODELS, "rw")])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("done:"), r.stdout
    r = image.run(nginx.url("bundle.tar.gz"), MODELS, env=PROGRESS, mounts=[(vol_b, MODELS, "rw")])
    assert r.returncode == 0, r.stderr

    assert served(image, vol_a) == {"model.bin": sha(weights)}
    assert served(image, vol_b) == {"cfg/config.json": sha(b'{"arch": "x"}'), "tok/tokenizer.json": sha(tokenizer)}
    # Written by the image's own user (KServe's 1000), not root.
    assert owners(vol_a) | owners(vol_b) == {(1000, 1000)}


def test_s3_pull_into_a_volume(image: Image, moto_s3: S3Server, tmp_path: Path) -> None:
    bucket = moto_s3.new_bucket()
    tree = model_tree()
    s3 = moto_s3.client()
    for key, data in tree.items():
        s3.put_object(Bucket=bucket, Key=f"llm/{key}", Body=data)
    vol = emptydir(tmp_path / "vol")
    r = image.run(f"s3://{bucket}/llm", MODELS, env={**moto_s3.env(), **PROGRESS}, mounts=[(vol, MODELS, "rw")])
    assert r.returncode == 0, r.stderr
    assert served(image, vol) == {k: sha(v) for k, v in tree.items()}
    assert moto_s3.secret_key not in r.stdout + r.stderr


def error_lines(text: str, dest: str) -> list[str]:
    """stderr without the closing summary (its duration may differ), DEST named alike."""
    return [line.replace(dest, "DEST") for line in text.strip().splitlines() if not line.startswith("FAILED:")]


@pytest.mark.parametrize("case", ["http-404", "s3-no-bucket", "bad-uri", "usage"])
def test_errors_match_outside_the_container(case: str, image: Image, nginx: NginxServer, moto_s3: S3Server,
                                            tmp_path: Path) -> None:
    env: dict[str, str] = {}
    if case == "http-404":
        args = [nginx.url("status/404/model.bin")]
    elif case == "s3-no-bucket":
        args, env = ["s3://no-such-bucket-modelcache/llm"], {**moto_s3.env(), "S3_MAX_ATTEMPTS": "1"}
    elif case == "bad-uri":
        args = ["nosuch://host/model"]
    else:
        args = []  # no DEST
    vol = emptydir(tmp_path / "vol")
    outside_dest = tmp_path / "outside"
    inside = image.run(*args, *([MODELS] if args else []), env=env, mounts=[(vol, MODELS, "rw")])
    outside = run_initializer(*args, *([outside_dest] if args else []), env=env)
    assert outside.code != 0
    assert inside.returncode == outside.code, (inside.stderr, outside.err)
    lines = error_lines(inside.stderr, MODELS)
    assert len(lines) == 1, inside.stderr  # one line, naming the URI
    assert lines == error_lines(outside.err, str(outside_dest))
    if args:
        assert lines[0].startswith(f"error: {args[0]} -> DEST: ")


def test_kerberized_hdfs_pull_in_the_image(image: Image, mini_hdfs_kerberos: SecureHDFS, tmp_path: Path) -> None:
    """HDFS with Kerberos from the image, as KServe's initializer does it: the HDFS secret mounted
    at its default path (KERBEROS_PRINCIPAL, KERBEROS_KEYTAB, HDFS_NAMENODE) and a krb5.conf from
    the pod. The image carries gssapi and MIT Kerberos' library (before, it said one line:
    "needs the Python packages gssapi and requests-gssapi")."""
    cluster = mini_hdfs_kerberos
    assert cluster.kdc is not None and cluster.user_keytab is not None
    top = cluster.folder()
    files = {"config.json": b'{"a": 1}', "weights/model.bin": os.urandom((2 << 20) + 4321)}
    for rel, data in files.items():
        cluster.put(f"{top}/m/{rel}", data)
    secret = tmp_path / "hdfscreds"
    secret.mkdir()
    for name, value in {"HDFS_NAMENODE": cluster.url.encode(), "KERBEROS_PRINCIPAL": cluster.user.encode(),
                        "KERBEROS_KEYTAB": cluster.user_keytab.read_bytes()}.items():
        (secret / name).write_bytes(value)
        (secret / name).chmod(0o644)  # a Secret volume's default mode
    secret.chmod(0o755)
    krb5_conf = tmp_path / "krb5.conf"
    krb5_conf.write_bytes(cluster.kdc.krb5_conf.read_bytes())
    krb5_conf.chmod(0o644)
    volume = emptydir(tmp_path / "vol")

    r = image.run(f"hdfs:/{top}/m", MODELS, env={"KRB5_CONFIG": "/etc/krb5.conf"},
                  mounts=[(volume, MODELS, "rw"), (secret, "/var/secrets/kserve-hdfscreds", "ro"),
                          (krb5_conf, "/etc/krb5.conf", "ro")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert served(image, volume) == {rel: sha(data) for rel, data in files.items()}
