"""The S3 source against moto_server: listing bounded by '/', checksums, ranged reads, errors."""

from __future__ import annotations

import math
import os

import pytest
from boto3.s3.transfer import TransferConfig

from modelcache.errors import AccessDeniedError, AuthError, NotFoundError, SourceError, TransientError
from modelcache.sources.base import open_source
from tests.fixtures.s3 import S3Server
from tests.helpers import free_port
from tests.objectstore_data import crc32_hex, md5_hex, model_tree, read_range, settings

PART = 5 << 20


@pytest.fixture
def s3_model(moto_s3: S3Server, tmp_path) -> tuple[str, dict[str, bytes]]:
    """Bucket with model/ (tree + multipart object + folder marker), a model_v2/ sibling and a
    single object."""
    bucket = moto_s3.new_bucket()
    c = moto_s3.client()
    tree = model_tree()
    for name, data in tree.items():
        c.put_object(Bucket=bucket, Key=f"model/{name}", Body=data)
    c.put_object(Bucket=bucket, Key="model/weights/", Body=b"")  # folder marker
    c.put_object(Bucket=bucket, Key="model_v2/other.bin", Body=b"not mine")
    c.put_object(Bucket=bucket, Key="model.tar", Body=b"single object")
    mp = os.urandom(2 * PART + 12345)
    path = tmp_path / "mp.bin"
    path.write_bytes(mp)
    c.upload_file(
        str(path),
        bucket,
        "model/big/multipart.bin",
        Config=TransferConfig(multipart_threshold=PART, multipart_chunksize=PART),
    )
    tree["big/multipart.bin"] = mp
    return bucket, tree


def test_lists_folder_bounded_with_checksums(moto_s3: S3Server, s3_model) -> None:
    bucket, tree = s3_model
    with open_source(f"s3://{bucket}/model", settings(moto_s3.env())) as src:
        files = {f.path: f for f in src.list_files()}
        assert sorted(files) == sorted(tree)  # no folder marker, no model_v2/, zero-byte kept
        for path, data in tree.items():
            f = files[path]
            assert f.size == len(data)
            assert f.version
            algos = {c.algo: c for c in f.checksums}
            if path == "big/multipart.bin":
                etag = algos["s3-etag"]
                parts = [data[i : i + PART] for i in range(0, len(data), PART)]
                import hashlib

                composite = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
                assert etag.value == f"{composite}-{math.ceil(len(data) / PART)}"
                assert etag.param("part_size") == str(PART)
                assert etag.param("parts") == str(math.ceil(len(data) / PART))
                assert "md5" not in algos
            elif "crc32" in algos:  # boto3 >= 1.36 uploads with a CRC32 that S3 keeps: preferred to MD5
                assert algos["crc32"].value == crc32_hex(data) and "md5" not in algos
            else:
                assert algos["md5"].value == md5_hex(data)
            # every value is lower-case hex
            for c in f.checksums:
                assert c.value == c.value.lower() and int(c.value.split("-")[0], 16) >= 0
            assert read_range(src, f) == data
        big = files["weights/model-00001.safetensors"]
        data = tree[big.path]
        assert read_range(src, big, 1 << 20, 2 << 20) == data[1 << 20 : 2 << 20]
        assert read_range(src, big, (3 << 20) - 10, None) == data[-10:]
        assert read_range(src, files["empty.txt"], 0, None) == b""


def test_trailing_slash_and_bucket_root(moto_s3: S3Server, s3_model) -> None:
    bucket, tree = s3_model
    env = settings(moto_s3.env())
    with open_source(f"s3://{bucket}/model/", env) as src:
        assert sorted(f.path for f in src.list_files()) == sorted(tree)
    with open_source(f"s3://{bucket}", env) as src:
        paths = {f.path for f in src.list_files()}
    assert {"model.tar", "model_v2/other.bin", "model/config.json"} <= paths


def test_single_object_uri_uses_basename(moto_s3: S3Server, s3_model) -> None:
    bucket, _ = s3_model
    with open_source(f"s3://{bucket}/model.tar", settings(moto_s3.env())) as src:
        (f,) = src.list_files()
        assert f.path == "model.tar"
        assert read_range(src, f) == b"single object"
        assert {c.value for c in f.checksums} & {md5_hex(b"single object"), crc32_hex(b"single object")}


def test_full_object_sha256_is_reported(moto_s3: S3Server) -> None:
    import hashlib

    bucket = moto_s3.new_bucket()
    data = os.urandom(1000)
    moto_s3.client().put_object(Bucket=bucket, Key="m/w.bin", Body=data, ChecksumAlgorithm="SHA256")
    with open_source(f"s3://{bucket}/m", settings(moto_s3.env())) as src:
        (f,) = src.list_files()
    algos = {c.algo: c.value for c in f.checksums}
    assert algos == {"sha256": hashlib.sha256(data).hexdigest()}


def test_md5_etag_when_no_full_object_checksum(moto_s3: S3Server) -> None:
    """An object uploaded without a checksum (older SDKs, other tools): the ETag MD5 is used."""
    bucket = moto_s3.new_bucket()
    data = os.urandom(1000)
    c = moto_s3.client()
    c.meta.config.request_checksum_calculation = "when_required"
    c.put_object(Bucket=bucket, Key="m/w.bin", Body=data)
    with open_source(f"s3://{bucket}/m", settings(moto_s3.env())) as src:
        (f,) = src.list_files()
    assert [(c.algo, c.value) for c in f.checksums] == [("md5", md5_hex(data))]


def test_overwrite_after_listing_is_detected(moto_s3: S3Server) -> None:
    bucket = moto_s3.new_bucket()
    c = moto_s3.client()
    c.put_object(Bucket=bucket, Key="m/w.bin", Body=b"version one")
    with open_source(f"s3://{bucket}/m", settings(moto_s3.env())) as src:
        (f,) = src.list_files()
        c.put_object(Bucket=bucket, Key="m/w.bin", Body=b"version two")
        with pytest.raises(SourceError, match="changed while it was being downloaded"):
            read_range(src, f)


def test_empty_prefix_missing_bucket(moto_s3: S3Server, s3_model) -> None:
    bucket, _ = s3_model
    env = settings(moto_s3.env())
    with (
        pytest.raises(NotFoundError, match=rf"no model found at s3://{bucket}/mode\b"),
        open_source(f"s3://{bucket}/mode", env) as src,
    ):
        src.list_files()  # 'mode' is a string prefix of 'model/' but not a folder
    with (
        pytest.raises(NotFoundError, match="S3 bucket 'no-such-bucket' does not exist"),
        open_source("s3://no-such-bucket/model", env) as src,
    ):
        src.list_files()


def test_bad_credentials_and_access_denied(moto_s3: S3Server, s3_model) -> None:
    bucket, _ = s3_model
    uri = f"s3://{bucket}/model"
    env = moto_s3.env() | {"AWS_SECRET_ACCESS_KEY": "wrong-secret-value"}
    with pytest.raises(AuthError) as err, open_source(uri, settings(env)) as src:
        src.list_files()
    assert uri in str(err.value) and "AWS_SECRET_ACCESS_KEY" in str(err.value)
    assert "wrong-secret-value" not in str(err.value)
    key, secret = moto_s3.add_user(["s3:ListBucket"])
    env = moto_s3.env() | {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    with (
        pytest.raises(AccessDeniedError, match="access denied to s3://") as err,
        open_source(uri, settings(env)) as src,
    ):
        src.list_files()
    assert secret not in str(err.value) and key not in str(err.value)


def test_unreachable_and_tls(moto_s3: S3Server, s3_model) -> None:
    bucket, _ = s3_model
    uri = f"s3://{bucket}/model"
    port = free_port()
    env = moto_s3.env() | {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "S3_MAX_ATTEMPTS": "1"}
    with (
        pytest.raises(TransientError, match=f"cannot connect to S3 endpoint http://127.0.0.1:{port} for {uri}"),
        open_source(uri, settings(env)) as src,
    ):
        src.list_files()
    # TLS against a plain-HTTP server: the handshake fails.
    tls = moto_s3.endpoint.replace("http://", "https://")
    env = moto_s3.env() | {"AWS_ENDPOINT_URL": tls, "S3_MAX_ATTEMPTS": "1"}
    with (
        pytest.raises(SourceError, match=r"TLS handshake/verification failed .*AWS_CA_BUNDLE"),
        open_source(uri, settings(env)) as src,
    ):
        src.list_files()


def test_s3_endpoint_and_use_https_from_annotations(moto_s3: S3Server, s3_model) -> None:
    """S3_ENDPOINT + S3_USE_HTTPS=0 (what KServe's controller sets) reach the server."""
    bucket, tree = s3_model
    env = moto_s3.env()
    del env["AWS_ENDPOINT_URL"]
    env |= {"S3_ENDPOINT": moto_s3.endpoint.removeprefix("http://"), "S3_USE_HTTPS": "0"}
    with open_source(f"s3://{bucket}/model", settings(env)) as src:
        assert len(src.list_files()) == len(tree)


def test_anonymous_public_and_private(moto_s3_open: str, tmp_path) -> None:
    import boto3

    admin = boto3.client(
        "s3", endpoint_url=moto_s3_open, region_name="us-east-1", aws_access_key_id="a", aws_secret_access_key="b"
    )
    admin.create_bucket(Bucket="public-models", ACL="public-read")
    admin.put_object(Bucket="public-models", Key="m/w.bin", Body=b"public bytes", ACL="public-read")
    admin.create_bucket(Bucket="private-models")
    admin.put_object(Bucket="private-models", Key="m/w.bin", Body=b"private bytes")
    env = {"AWS_ENDPOINT_URL": moto_s3_open, "awsAnonymousCredential": "true", "AWS_DEFAULT_REGION": "us-east-1"}
    with open_source("s3://public-models/m", settings(env)) as src:
        (f,) = src.list_files()
        assert read_range(src, f) == b"public bytes"
    with (
        pytest.raises(AccessDeniedError, match=r"anonymous access .*awsAnonymousCredential"),
        open_source("s3://private-models/m", settings(env)) as src,
    ):
        src.list_files()


class _Stop(Exception):
    pass


def _first_request(env: dict[str, str], uri: str = "s3://models-bucket/model") -> tuple[str, dict[str, str]]:
    """URL and headers of the first request the source sends, caught by botocore's public
    ``before-send`` event (after signing) -- for addressing modes no local server can resolve."""
    seen: list[tuple[str, dict[str, str]]] = []

    def grab(request, **kwargs) -> None:
        seen.append((request.url, {k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}))
        raise _Stop

    keys = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "example-secret"}
    with open_source(uri, settings(keys | env)) as src:
        src.client.meta.events.register("before-send.s3", grab)
        with pytest.raises(_Stop):
            src.list_files()
    return seen[0]


@pytest.mark.parametrize(
    ("env", "url_start"),
    [
        ({"AWS_ENDPOINT_URL": "https://minio.example:9000"}, "https://minio.example:9000/models-bucket?"),
        (
            {"AWS_ENDPOINT_URL": "https://minio.example:9000", "S3_USER_VIRTUAL_BUCKET": "true"},
            "https://models-bucket.minio.example:9000/?",
        ),
        (
            {"AWS_DEFAULT_REGION": "us-west-2", "S3_USE_ACCELERATE": "true"},
            "https://models-bucket.s3-accelerate.amazonaws.com/?",
        ),
        ({"AWS_DEFAULT_REGION": "us-west-2"}, "https://models-bucket.s3.us-west-2.amazonaws.com/?"),
        # KServe: the legacy global endpoint outside us-east-1 forces virtual hosting
        (
            {"AWS_ENDPOINT_URL": "https://s3.amazonaws.com", "AWS_DEFAULT_REGION": "eu-west-1"},
            "https://models-bucket.s3.amazonaws.com/?",
        ),
        ({"S3_ENDPOINT": "minio.example:9000", "S3_USE_HTTPS": "0"}, "http://minio.example:9000/models-bucket?"),
    ],
)
def test_addressing_from_kserve_env(env: dict[str, str], url_start: str) -> None:
    url, headers = _first_request(env)
    assert url.startswith(url_start), url
    assert "list-type=2" in url and "prefix=model%2F" in url
    assert "AKIDEXAMPLE" in headers["Authorization"]


def test_signing_follows_anonymous_and_session_token() -> None:
    _, headers = _first_request({"AWS_ENDPOINT_URL": "https://minio.example:9000", "awsAnonymousCredential": "true"})
    assert "Authorization" not in headers
    _, headers = _first_request({"AWS_ENDPOINT_URL": "https://minio.example:9000", "AWS_SESSION_TOKEN": "tok-123"})
    assert headers["X-Amz-Security-Token"] == "tok-123"


def test_full_object_crc32c_is_reported(moto_s3: S3Server) -> None:
    """CRC32C (what newer SDKs and S3 Express use), given by the uploader: preferred over the ETag."""
    from tests.objectstore_data import b64, crc32c_hex

    bucket = moto_s3.new_bucket()
    data = os.urandom(1000)
    c = moto_s3.client()
    c.put_object(
        Bucket=bucket, Key="m/w.bin", Body=data, ChecksumAlgorithm="CRC32C", ChecksumCRC32C=b64(crc32c_hex(data))
    )
    with open_source(f"s3://{bucket}/m", settings(moto_s3.env())) as src:
        (f,) = src.list_files()
    assert {c.algo: c.value for c in f.checksums} == {"crc32c": crc32c_hex(data)}
