"""The Azure Blob source against Azurite: listing, Content-MD5, ETag pinning, credentials, errors."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from modelcache.errors import AccessDeniedError, AuthError, NotFoundError, SourceError, TransientError, UnsupportedError
from modelcache.sources.base import open_source
from modelcache.sources.uri import parse_uri
from tests.fixtures.azure import AzureServer
from tests.helpers import free_port
from tests.objectstore_data import md5_hex, model_tree, read_range, settings


@pytest.fixture
def az_model(azurite: AzureServer) -> tuple[str, dict[str, bytes]]:
    container = azurite.new_container()
    cc = azurite.service().get_container_client(container)
    tree = model_tree()
    for name, data in tree.items():
        cc.upload_blob(f"model/{name}", data)
    cc.upload_blob("model/weights/", b"")  # folder marker
    cc.upload_blob("model_v2/other.bin", b"not mine")
    cc.upload_blob("model.tar", b"single object")
    # Staged blocks: a blob without Content-MD5 (as on real Azure)
    bc = cc.get_blob_client("model/staged.bin")
    bc.stage_block("YmxrMQ==", b"a" * 1000)
    bc.stage_block("YmxrMg==", b"b" * 500)
    bc.commit_block_list(["YmxrMQ==", "YmxrMg=="])
    tree["staged.bin"] = b"a" * 1000 + b"b" * 500
    return container, tree


def test_lists_folder_bounded_with_md5(azurite: AzureServer, az_model) -> None:
    container, tree = az_model
    with open_source(azurite.uri(container, "model"), settings(azurite.env())) as src:
        files = {f.path: f for f in src.list_files()}
        assert sorted(files) == sorted(tree)
        for path, data in tree.items():
            f = files[path]
            assert f.size == len(data) and f.version
            algos = {c.algo: c.value for c in f.checksums}
            assert algos == ({} if path == "staged.bin" else {"md5": md5_hex(data)})
            assert read_range(src, f) == data
        big = files["weights/model-00001.safetensors"]
        data = tree[big.path]
        assert read_range(src, big, 1 << 20, (2 << 20) + 3) == data[1 << 20 : (2 << 20) + 3]
        assert read_range(src, big, (3 << 20) - 10, None) == data[-10:]


def test_single_object_and_blob_storage_host_form(azurite: AzureServer, az_model) -> None:
    container, _ = az_model
    env = settings(azurite.env())
    with open_source(azurite.uri(container, "model.tar"), env) as src:
        (f,) = src.list_files()
        assert f.path == "model.tar" and read_range(src, f) == b"single object"
    uri = f"https://{azurite.account}.z7.blob.storage.azure.net/{container}/model.tar"
    with open_source(uri, env) as src:
        assert [f.path for f in src.list_files()] == ["model.tar"]


def test_sas_query_is_kept_and_never_printed(azurite: AzureServer, az_model) -> None:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    container, tree = az_model
    expiry = datetime.now(UTC) + timedelta(hours=1)
    sas = generate_container_sas(
        azurite.account,
        container,
        account_key=azurite.key,
        permission=ContainerSasPermissions(read=True),
        expiry=expiry,
    )
    env = {"MODELCACHE_AZURE_BLOB_ENDPOINT": azurite.env()["MODELCACHE_AZURE_BLOB_ENDPOINT"]}  # no key
    uri = azurite.uri(container, "model") + "?" + sas
    # read without list permission: listing is denied, and the message hides the SAS
    with pytest.raises(AccessDeniedError) as err, open_source(uri, settings(env)) as src:
        src.list_files()
    assert "sig=" not in str(err.value) and sas not in str(err.value) and "<redacted>" in str(err.value)
    sas = generate_container_sas(
        azurite.account,
        container,
        account_key=azurite.key,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=expiry,
    )
    with open_source(azurite.uri(container, "model") + "?" + sas, settings(env)) as src:
        assert "sig=" not in src.resolved_uri
        files = src.list_files()
        f = next(f for f in files if f.path == "config.json")
        assert read_range(src, f) == tree["config.json"]


def test_overwrite_after_listing_is_detected(azurite: AzureServer, az_model) -> None:
    container, _ = az_model
    with open_source(azurite.uri(container, "model"), settings(azurite.env())) as src:
        f = next(f for f in src.list_files() if f.path == "config.json")
        azurite.service().get_blob_client(container, "model/config.json").upload_blob(b"new", overwrite=True)
        with pytest.raises(SourceError, match="changed while it was being downloaded"):
            read_range(src, f)


def test_errors(azurite: AzureServer, az_model) -> None:
    container, _ = az_model
    ok = azurite.env()
    with (
        pytest.raises(NotFoundError, match=f"no model found at {azurite.uri(container, 'mode')}:"),
        open_source(azurite.uri(container, "mode"), settings(ok)) as src,
    ):
        src.list_files()
    with (
        pytest.raises(NotFoundError, match="Azure container 'no-such-container' does not exist"),
        open_source(azurite.uri("no-such-container", "model"), settings(ok)) as src,
    ):
        src.list_files()
    bad_key = "QmFkS2V5QmFkS2V5QmFkS2V5QmFkS2V5QmFkS2V5QmFkS2V5"
    with (
        pytest.raises(AuthError, match="Azure rejected the credentials") as err,
        open_source(azurite.uri(container, "model"), settings(ok | {"AZURE_STORAGE_ACCESS_KEY": bad_key})) as src,
    ):
        src.list_files()
    assert bad_key not in str(err.value)
    port = free_port()
    env = {
        "MODELCACHE_AZURE_BLOB_ENDPOINT": f"http://127.0.0.1:{port}/{{account}}",
        "MODELCACHE_AZURE_RETRY_TOTAL": "0",
    }
    with (
        pytest.raises(TransientError, match=f"cannot connect to Azure Blob endpoint http://127.0.0.1:{port}"),
        open_source(azurite.uri(container, "model"), settings(env)) as src,
    ):
        src.list_files()


def test_file_share_uri_is_rejected() -> None:
    uri = "https://acct.file.core.windows.net/share/model?sv=2020&sig=SECRETSIG"
    with pytest.raises(UnsupportedError, match="Azure File share URIs are not supported") as err:
        parse_uri(uri)
    assert "https://acct.file.core.windows.net/share/model" in str(err.value) and "SECRETSIG" not in str(err.value)


def test_anonymous_read_of_a_public_container(azurite: AzureServer, az_model) -> None:
    container, tree = az_model
    uri = azurite.uri(container, "model")
    env = {"MODELCACHE_AZURE_BLOB_ENDPOINT": azurite.env()["MODELCACHE_AZURE_BLOB_ENDPOINT"]}  # no credentials
    with (
        pytest.raises(AuthError, match=f"anonymous access to {uri} was refused"),
        open_source(uri, settings(env)) as src,
    ):
        src.list_files()  # private container
    azurite.service().get_container_client(container).set_container_access_policy(
        signed_identifiers={}, public_access="container"
    )
    with open_source(uri, settings(env)) as src:
        files = {f.path: f for f in src.list_files()}
        assert sorted(files) == sorted(tree)
        assert read_range(src, files["config.json"]) == tree["config.json"]
