"""The GCS source against gcp-storage-emulator: listing, crc32c/md5, generation pinning, errors."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from modelcache.errors import AuthError, NotFoundError, TransientError
from modelcache.sources.base import open_source
from tests.fixtures.gcs import GCSServer
from tests.helpers import free_port, wait_until
from tests.objectstore_data import crc32c_hex, model_tree, read_range, settings


@pytest.fixture
def gcs_model(gcs_emulator: GCSServer) -> tuple[str, dict[str, bytes]]:
    bucket_name = gcs_emulator.new_bucket()
    bucket = gcs_emulator.client().bucket(bucket_name)
    tree = model_tree()
    for name, data in tree.items():
        bucket.blob(f"model/{name}").upload_from_string(data)
    bucket.blob("model/weights/").upload_from_string(b"")  # folder marker
    bucket.blob("model_v2/other.bin").upload_from_string(b"not mine")
    bucket.blob("model.tar").upload_from_string(b"single object")
    return bucket_name, tree


def test_lists_folder_bounded_with_checksums(gcs_emulator: GCSServer, gcs_model) -> None:
    bucket, tree = gcs_model
    with open_source(f"gs://{bucket}/model", settings(gcs_emulator.env())) as src:
        files = {f.path: f for f in src.list_files()}
        assert sorted(files) == sorted(tree)
        for path, data in tree.items():
            f = files[path]
            assert f.size == len(data)
            assert f.version and f.version.isdigit()  # the generation
            algos = {c.algo: c.value for c in f.checksums}
            assert algos == {"crc32c": crc32c_hex(data)}  # md5 only as a fallback (CPU)
            assert read_range(src, f) == data
        big = files["weights/model-00001.safetensors"]
        data = tree[big.path]
        assert read_range(src, big, 1 << 20, (2 << 20) + 7) == data[1 << 20 : (2 << 20) + 7]
        assert read_range(src, big, (3 << 20) - 10, None) == data[-10:]
    # With peer transfer (a pull's forgery_proof) the md5 comes too: a crc32c proves nothing against
    # bytes forged on purpose, and a file without an unforgeable checksum is read twice from the
    # origin by a group (docs/peers.md, "Trust nothing from a peer").
    with open_source(f"gs://{bucket}/model", dataclasses.replace(settings(gcs_emulator.env()),
                                                                  forgery_proof=True)) as src:
        for f in src.list_files():
            algos = {c.algo: c.value for c in f.checksums}
            assert algos == {"crc32c": crc32c_hex(tree[f.path]), "md5": hashlib.md5(tree[f.path]).hexdigest()}


def test_single_object_and_trailing_slash(gcs_emulator: GCSServer, gcs_model) -> None:
    bucket, tree = gcs_model
    env = settings(gcs_emulator.env())
    with open_source(f"gs://{bucket}/model.tar", env) as src:
        (f,) = src.list_files()
        assert f.path == "model.tar" and read_range(src, f) == b"single object"
    with open_source(f"gs://{bucket}/model/", env) as src:
        assert len(src.list_files()) == len(tree)


def test_empty_prefix_and_missing_bucket(gcs_emulator: GCSServer, gcs_model) -> None:
    bucket, _ = gcs_model
    env = settings(gcs_emulator.env())
    with (
        pytest.raises(NotFoundError, match=f"no model found at gs://{bucket}/mode:"),
        open_source(f"gs://{bucket}/mode", env) as src,
    ):
        src.list_files()
    with (
        pytest.raises(NotFoundError, match="GCS bucket 'no-such-bucket' does not exist"),
        open_source("gs://no-such-bucket/model", env) as src,
    ):
        src.list_files()


def test_bad_credentials_file(gcs_model, tmp_path) -> None:
    bucket, _ = gcs_model
    bad = tmp_path / "sa.json"
    bad.write_text(json.dumps({"type": "service_account", "private_key": "-----BEGIN secretvalue123"}))
    uri = f"gs://{bucket}/model"
    with pytest.raises(AuthError) as err, open_source(uri, settings({"GOOGLE_APPLICATION_CREDENTIALS": str(bad)})) as s:
        s.list_files()
    assert uri in str(err.value) and "GOOGLE_APPLICATION_CREDENTIALS" in str(err.value)
    assert "secretvalue123" not in str(err.value)


def test_unreachable(gcs_model) -> None:
    bucket, _ = gcs_model
    port = free_port()
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "MODELCACHE_GCS_RETRY_DEADLINE": "1"}
    with (
        pytest.raises(TransientError, match=f"cannot connect to GCS endpoint http://127.0.0.1:{port}"),
        open_source(f"gs://{bucket}/model", settings(env)) as src,
    ):
        src.list_files()


def test_reads_are_pinned_to_the_listed_generation(gcs_emulator: GCSServer, gcs_model, relay_proxy) -> None:
    """The emulator ignores `generation=` on media GETs, so check what we ask for on the wire."""
    bucket, tree = gcs_model
    proxy = relay_proxy(gcs_emulator.endpoint)
    with open_source(f"gs://{bucket}/model", settings(gcs_emulator.env(proxy.url))) as src:
        f = next(f for f in src.list_files() if f.path == "config.json")
        assert read_range(src, f) == tree["config.json"]

    def media_gets() -> list[str]:
        with proxy.log.lock:  # the relay logs a request once its body is sent: wait for it
            return [p for m, p, _ in proxy.log.requests if m == "GET" and "alt=media" in p]

    wait_until(lambda: bool(media_gets()), timeout=10, what="the relay's log of the media GET")
    assert all(f"generation={f.version}" in p for p in media_gets())


def test_rejected_service_account_key(tmp_path) -> None:
    """A well-formed key that the token endpoint refuses (revoked / deleted): a real OAuth
    exchange against a local token server answering 400 invalid_grant, as Google does."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    hits: list[str] = []

    class Token(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hits.append(self.path)
            body = b'{"error": "invalid_grant", "error_description": "Invalid JWT Signature."}'
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Token)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
        sa = {
            "type": "service_account",
            "project_id": "p",
            "private_key_id": "kid-123",
            "private_key": pem,
            "client_email": "loader@p.iam.gserviceaccount.com",
            "token_uri": f"http://127.0.0.1:{server.server_address[1]}/token",
        }
        path = tmp_path / "sa.json"
        path.write_text(json.dumps(sa))
        uri = "gs://some-bucket/model"
        env = {"GOOGLE_APPLICATION_CREDENTIALS": str(path), "MODELCACHE_GCS_RETRY_DEADLINE": "2"}
        with (
            pytest.raises(AuthError, match="Google authentication failed") as err,
            open_source(uri, settings(env)) as s,
        ):
            s.list_files()
        assert uri in str(err.value) and "GOOGLE_APPLICATION_CREDENTIALS" in str(err.value)
        assert "PRIVATE KEY" not in str(err.value)
        assert hits and set(hits) == {"/token"}  # the key was really exchanged, and refused
    finally:
        server.shutdown()
        server.server_close()
