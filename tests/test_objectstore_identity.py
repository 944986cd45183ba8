"""Object-store credentials that need more than a key, end to end through ``modelcache pull``:
AWS temporary credentials (AWS_SESSION_TOKEN, checked by moto's IAM), S3 over TLS (S3_VERIFY_SSL,
AWS_CA_BUNDLE, a certificate that fails verification), Google service-account keys exchanged for
tokens at a local token endpoint (GOOGLE_APPLICATION_CREDENTIALS and the storage spec; bad key,
access denied), and Azure AD service principals and
workload identity (legacy AZ_* names, AZURE_AUTHORITY_HOST at a local Entra-shaped token
service, bearer tokens checked by Azurite's ``--oauth basic``). The runs log at DEBUG, and every
output goes into the secret grep of test_objectstore_pull.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.azure import AzureServer
from tests.fixtures.entra import EntraTokenServer
from tests.fixtures.gcs import GCSAuthFront, GCSServer
from tests.fixtures.s3 import S3Server
from tests.fixtures.tls import TLSPair
from tests.helpers import unique
from tests.objectstore_cli import SECRETS, fails_with, pull
from tests.objectstore_data import model_tree
from tests.pull_helpers import assert_store_correct

DEBUG = {"MODELCACHE_LOG_LEVEL": "DEBUG"}


def _temporary_credentials(server: S3Server) -> dict[str, str]:
    """AssumeRole on moto: a key id, secret and session token that moto's IAM checks together."""
    import boto3

    iam = server._iam
    name = unique("reader")
    trust = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}],
    }
    role = iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))["Role"]
    read = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetObject"], "Resource": "*"}],
    }
    iam.put_role_policy(RoleName=name, PolicyName="read", PolicyDocument=json.dumps(read))
    sts = boto3.client(
        "sts",
        endpoint_url=server.endpoint,
        region_name=server.region,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
    )
    creds = sts.assume_role(RoleArn=role["Arn"], RoleSessionName="modelcache-test")["Credentials"]
    SECRETS.update({creds["SecretAccessKey"], creds["SessionToken"]})
    return {
        "AWS_ACCESS_KEY_ID": creds["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
        "AWS_SESSION_TOKEN": creds["SessionToken"],
    }


def test_s3_session_token(moto_s3: S3Server, tmp_path: Path) -> None:
    bucket = moto_s3.new_bucket()
    tree = model_tree()
    for name, data in tree.items():
        moto_s3.client().put_object(Bucket=bucket, Key=f"model/{name}", Body=data)
    uri = f"s3://{bucket}/model"
    endpoint = {"AWS_ENDPOINT_URL": moto_s3.endpoint, "AWS_DEFAULT_REGION": moto_s3.region}
    temp = _temporary_credentials(moto_s3)
    r = pull(tmp_path / "a", uri, endpoint | temp | DEBUG)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_store_correct(tmp_path / "a", {uri: tree}, must_have={uri})
    # The token is really checked: a wrong one, or none, is refused with the one-line error.
    wrong = "wrong-token-" + os.urandom(8).hex()
    SECRETS.add(wrong)
    fails_with(
        tmp_path / "b",
        uri,
        endpoint | temp | {"AWS_SESSION_TOKEN": wrong},
        "rejected the credentials",
        "InvalidToken",
        "AWS_SESSION_TOKEN",
    )
    no_token = {k: v for k, v in temp.items() if k != "AWS_SESSION_TOKEN"}
    fails_with(tmp_path / "c", uri, endpoint | no_token, "rejected the credentials", uri)


def test_s3_web_identity_irsa(moto_s3_open: str, tmp_path: Path) -> None:
    """IRSA: no keys, AWS_ROLE_ARN + AWS_WEB_IDENTITY_TOKEN_FILE; boto3's default chain trades the
    projected token at STS (AWS_ENDPOINT_URL covers STS too) for temporary credentials. moto's
    STS needs signed calls once IAM auth is on, so this runs on the auth-less moto: the proof is
    that the pull works at all with no other credential source (instance metadata disabled)."""
    import boto3

    admin = boto3.client(
        "s3", endpoint_url=moto_s3_open, region_name="us-east-1", aws_access_key_id="a", aws_secret_access_key="b"
    )
    bucket = unique("models")
    admin.create_bucket(Bucket=bucket)
    admin.put_object(Bucket=bucket, Key="m/w.bin", Body=b"irsa" * 100)
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6bnM6c2EifQ.c2ln")
    uri = f"s3://{bucket}/m"
    env = {
        "AWS_ENDPOINT_URL": moto_s3_open,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }
    fails_with(tmp_path / "a", uri, env, ": no AWS credentials: set AWS_ACCESS_KEY_ID", uri)  # nothing to find
    irsa = {"AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/model-reader", "AWS_WEB_IDENTITY_TOKEN_FILE": str(token)}
    r = pull(tmp_path / "b", uri, env | irsa)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_store_correct(tmp_path / "b", {uri: {"w.bin": b"irsa" * 100}}, must_have={uri})


# --- S3 over TLS -----------------------------------------------------------------------------------


def test_s3_tls_verify_ssl_and_ca_bundle(moto_s3_tls: str, tls_pair: TLSPair, tmp_path: Path) -> None:
    import boto3

    admin = boto3.client(
        "s3",
        endpoint_url=moto_s3_tls,
        region_name="us-east-1",
        aws_access_key_id="admin",
        aws_secret_access_key="admin-secret",
        verify=str(tls_pair.cert),
    )
    bucket = unique("models")
    admin.create_bucket(Bucket=bucket)
    admin.put_object(Bucket=bucket, Key="m/w.bin", Body=b"over tls" * 1000)
    uri = f"s3://{bucket}/m"
    env = {
        "AWS_ENDPOINT_URL": moto_s3_tls,
        "AWS_ACCESS_KEY_ID": "admin",
        "AWS_SECRET_ACCESS_KEY": "admin-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "S3_MAX_ATTEMPTS": "1",
    }
    # A certificate nobody vouches for: verification fails, one line naming the fix.
    fails_with(tmp_path / "a", uri, env, "TLS handshake/verification failed", moto_s3_tls, uri, "AWS_CA_BUNDLE")
    # AWS_CA_BUNDLE trusts it, as does the CA bundle ConfigMap; S3_VERIFY_SSL=0 turns verification off.
    mount = tmp_path / "custom-certs"
    mount.mkdir()
    (mount / "cabundle.crt").write_bytes(tls_pair.cert.read_bytes())
    configmap = {"CA_BUNDLE_CONFIGMAP_NAME": "global-ca-bundle", "CA_BUNDLE_VOLUME_MOUNT_POINT": str(mount)}
    for name, extra in (
        ("b", {"AWS_CA_BUNDLE": str(tls_pair.cert)}),
        ("c", {"S3_VERIFY_SSL": "0"}),
        ("g", configmap),  # KServe's CA bundle ConfigMap, when AWS_CA_BUNDLE is not set
    ):
        r = pull(tmp_path / name, uri, env | extra)
        assert r.returncode == 0, (extra, r.stderr[-2000:])
        assert_store_correct(tmp_path / name, {uri: {"w.bin": b"over tls" * 1000}}, must_have={uri})
    # The storage-spec secret's ca_bundle and verify_ssl reach the same settings.
    spec = {"type": "s3", "endpoint_url": moto_s3_tls, "access_key_id": "admin", "secret_access_key": "admin-secret"}
    for name, extra in (("d", {"ca_bundle": str(tls_pair.cert)}), ("e", {"verify_ssl": False})):
        r = pull(tmp_path / name, uri, {"STORAGE_CONFIG": json.dumps(spec | extra), "S3_MAX_ATTEMPTS": "1"})
        assert r.returncode == 0, (extra, r.stderr[-2000:])
    fails_with(tmp_path / "f", uri, {"STORAGE_CONFIG": json.dumps(spec), "S3_MAX_ATTEMPTS": "1"}, "TLS")


# --- Azure AD: service principal and workload identity ------------------------------------------


@pytest.fixture
def az_oauth_model(azurite_oauth: AzureServer, tls_pair: TLSPair) -> tuple[str, dict[str, bytes]]:
    from azure.storage.blob import BlobServiceClient

    svc = BlobServiceClient(
        azurite_oauth.endpoint,
        credential={"account_name": azurite_oauth.account, "account_key": azurite_oauth.key},
        connection_verify=str(tls_pair.cert),
    )
    container = unique("models")
    cc = svc.create_container(container)
    tree = model_tree()
    for name, data in tree.items():
        cc.upload_blob(f"model/{name}", data)
    return container, tree


def _azure_env(server: AzureServer, tls: TLSPair, tokens: EntraTokenServer) -> dict[str, str]:
    base = server.endpoint.rsplit("/", 1)[0]
    return {
        "MODELCACHE_AZURE_BLOB_ENDPOINT": base + "/{account}",
        "AZURE_AUTHORITY_HOST": tokens.url,
        "REQUESTS_CA_BUNDLE": str(tls.cert),  # trusts both the token service and Azurite
        "MODELCACHE_AZURE_RETRY_TOTAL": "0",
    }


def test_azure_service_principal_from_legacy_az_names(
    azurite_oauth: AzureServer,
    tls_pair: TLSPair,
    entra_token_server: EntraTokenServer,
    az_oauth_model: Any,
    tmp_path: Path,
) -> None:
    container, tree = az_oauth_model
    tokens = entra_token_server
    SECRETS.add(tokens.secret)
    uri = azurite_oauth.uri(container, "model")
    env = _azure_env(azurite_oauth, tls_pair, tokens)
    # Without credentials the private container is refused: the bearer token below is what opens it.
    fails_with(tmp_path / "anon", uri, env, "anonymous access to", uri)
    sp = {"AZ_CLIENT_ID": tokens.client_id, "AZ_CLIENT_SECRET": tokens.secret, "AZ_TENANT_ID": tokens.tenant}
    r = pull(tmp_path / "a", uri, env | sp | DEBUG)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_store_correct(tmp_path / "a", {uri: tree}, must_have={uri})
    assert tokens.grants and all(
        g["tenant"] == tokens.tenant
        and g["client_id"] == tokens.client_id
        and g["grant_type"] == "client_credentials"
        and g["scope"] == "https://storage.azure.com/.default"
        and g["proof"] == "secret"
        for g in tokens.grants
    ), tokens.grants
    # The identity wins over an account key (KServe's order): a wrong key does not matter.
    wrong_key = "V3Jvbmc" + os.urandom(8).hex() + "=="
    SECRETS.add(wrong_key)
    r = pull(tmp_path / "b", uri, env | sp | {"AZURE_STORAGE_ACCESS_KEY": wrong_key})
    assert r.returncode == 0, r.stderr[-2000:]
    # A wrong client secret: Entra's invalid_client becomes one line naming the variables.
    wrong = "wrong-sp-secret-" + os.urandom(6).hex()
    SECRETS.add(wrong)
    fails_with(
        tmp_path / "c", uri, env | sp | {"AZ_CLIENT_SECRET": wrong} | DEBUG, "Azure AD", uri, "AZURE_CLIENT_SECRET"
    )
    assert not (tmp_path / "c" / "models").exists() or not any((tmp_path / "c" / "models").iterdir())


def test_azure_service_principal_from_storage_config(
    azurite_oauth: AzureServer,
    tls_pair: TLSPair,
    entra_token_server: EntraTokenServer,
    az_oauth_model: Any,
    tmp_path: Path,
) -> None:
    container, tree = az_oauth_model
    tokens = entra_token_server
    SECRETS.add(tokens.secret)
    uri = azurite_oauth.uri(container, "model")
    env = _azure_env(azurite_oauth, tls_pair, tokens)
    spec = {"type": "azure", "client_id": tokens.client_id, "client_secret": "placeholder", "tenant_id": tokens.tenant}
    override = {"client_secret": tokens.secret}
    r = pull(tmp_path, uri, env | {"STORAGE_CONFIG": json.dumps(spec), "STORAGE_OVERRIDE_CONFIG": json.dumps(override)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert_store_correct(tmp_path, {uri: tree}, must_have={uri})
    assert tokens.grants and {g["proof"] for g in tokens.grants} == {"secret"}


def test_azure_workload_identity(
    azurite_oauth: AzureServer,
    tls_pair: TLSPair,
    entra_token_server: EntraTokenServer,
    az_oauth_model: Any,
    tmp_path: Path,
) -> None:
    """AKS workload identity: AZURE_CLIENT_ID + AZURE_TENANT_ID + AZURE_FEDERATED_TOKEN_FILE, the
    projected token sent as client assertion (what DefaultAzureCredential does in such a pod)."""
    container, tree = az_oauth_model
    tokens = entra_token_server
    SECRETS.add(tokens.federated_token)
    token_file = tmp_path / "azure-identity-token"
    token_file.write_text(tokens.federated_token)
    uri = azurite_oauth.uri(container, "model")
    env = _azure_env(azurite_oauth, tls_pair, tokens) | {
        "AZURE_CLIENT_ID": tokens.client_id,
        "AZURE_TENANT_ID": tokens.tenant,
        "AZURE_FEDERATED_TOKEN_FILE": str(token_file),
    }
    r = pull(tmp_path / "root", uri, env | DEBUG)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_store_correct(tmp_path / "root", {uri: tree}, must_have={uri})
    assert tokens.grants and {g["proof"] for g in tokens.grants} == {"assertion"}


def test_azure_tls_failure_names_the_fix(
    azurite_oauth: AzureServer, tls_pair: TLSPair, az_oauth_model: Any, tmp_path: Path
) -> None:
    """An https account URL whose certificate does not verify (no REQUESTS_CA_BUNDLE)."""
    container, _ = az_oauth_model
    uri = azurite_oauth.uri(container, "model")
    base = azurite_oauth.endpoint.rsplit("/", 1)[0]
    env = {
        "MODELCACHE_AZURE_BLOB_ENDPOINT": base + "/{account}",
        "AZURE_STORAGE_ACCESS_KEY": azurite_oauth.key,
        "MODELCACHE_AZURE_RETRY_TOTAL": "0",
    }
    SECRETS.add(azurite_oauth.key)
    fails_with(tmp_path, uri, env, "TLS handshake/verification failed", base, uri)


# --- GCS: service-account keys, tokens, access denied ----------------------------------------------


def test_gcs_service_account_key_file_and_storage_spec(
    gcs_emulator: GCSServer, gcs_auth_front: GCSAuthFront, tmp_path: Path
) -> None:
    import base64

    front = gcs_auth_front
    bucket = gcs_emulator.new_bucket()
    tree = model_tree()
    for name, data in tree.items():
        gcs_emulator.client().bucket(bucket).blob(f"model/{name}").upload_from_string(data)
    uri = f"gs://{bucket}/model"
    sa = front.service_account()
    SECRETS.add(sa["private_key"].splitlines()[1])
    key_file = tmp_path / "gcloud-application-credentials.json"
    key_file.write_text(json.dumps(sa))
    endpoint = {"MODELCACHE_GCS_ENDPOINT": front.url}
    # No credentials at all: the anonymous fallback reaches the front, which refuses it.
    fails_with(tmp_path / "anon", uri, endpoint, "anonymous access to", uri, "GOOGLE_APPLICATION_CREDENTIALS")
    assert not front.issued
    r = pull(tmp_path / "a", uri, endpoint | {"GOOGLE_APPLICATION_CREDENTIALS": str(key_file)} | DEBUG)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_store_correct(tmp_path / "a", {uri: tree}, must_have={uri})
    assert front.issued and front.authorized_requests >= len(tree)
    for token in front.issued:
        SECRETS.add(token)
    # The storage-spec secret's base64 service account (KServe's gs spec), no file involved.
    spec = {"type": "gs", "base64_service_account": base64.b64encode(json.dumps(sa).encode()).decode()}
    r = pull(tmp_path / "b", uri, endpoint | {"STORAGE_CONFIG": json.dumps(spec)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert_store_correct(tmp_path / "b", {uri: tree}, must_have={uri})
    # A well-formed key Google does not know (deleted, or another project's): the exchange fails.
    unknown = front.service_account(trusted=False)
    SECRETS.add(unknown["private_key"].splitlines()[1])
    # ... also when STORAGE_OVERRIDE_CONFIG lays it over a good spec: the override wins.
    override = {"base64_service_account": base64.b64encode(json.dumps(unknown).encode()).decode()}
    env = endpoint | {"STORAGE_CONFIG": json.dumps(spec), "STORAGE_OVERRIDE_CONFIG": json.dumps(override)}
    fails_with(tmp_path / "d", uri, env, "Google authentication failed", uri)
    key_file.write_text(json.dumps(unknown))
    fails_with(
        tmp_path / "c",
        uri,
        endpoint | {"GOOGLE_APPLICATION_CREDENTIALS": str(key_file)},
        "Google authentication failed",
        uri,
        "GOOGLE_APPLICATION_CREDENTIALS",
    )


def test_gcs_access_denied(gcs_emulator: GCSServer, gcs_auth_front: GCSAuthFront, tmp_path: Path) -> None:
    front = gcs_auth_front
    bucket = gcs_emulator.new_bucket()
    gcs_emulator.client().bucket(bucket).blob("model/config.json").upload_from_string(b"{}")
    front.denied.add(bucket)
    key_file = tmp_path / "sa.json"
    sa = front.service_account()
    SECRETS.add(sa["private_key"].splitlines()[1])
    key_file.write_text(json.dumps(sa))
    uri = f"gs://{bucket}/model"
    env = {"MODELCACHE_GCS_ENDPOINT": front.url, "GOOGLE_APPLICATION_CREDENTIALS": str(key_file)}
    fails_with(tmp_path, uri, env, "access denied to", uri, "storage.objects.list", bucket)


def test_gcs_md5_verifies_objects_without_crc32c(
    gcs_emulator: GCSServer, gcs_auth_front: GCSAuthFront, tmp_path: Path
) -> None:
    """md5 is the fallback when an object's metadata has no crc32c: a flipped byte still fails."""
    front = gcs_auth_front
    front.drop_crc32c = True
    bucket = gcs_emulator.new_bucket()
    data = os.urandom(600 * 1024)
    gcs_emulator.client().bucket(bucket).blob("model/w.bin").upload_from_string(data)
    key_file = tmp_path / "sa.json"
    sa = front.service_account()
    SECRETS.add(sa["private_key"].splitlines()[1])
    key_file.write_text(json.dumps(sa))
    uri = f"gs://{bucket}/model"
    env = {"MODELCACHE_GCS_ENDPOINT": front.url, "GOOGLE_APPLICATION_CREDENTIALS": str(key_file)}
    front.corrupt_media = True
    fails_with(tmp_path / "a", uri, env, uri, "w.bin", "mismatch", "md5")
    front.corrupt_media = False
    r = pull(tmp_path / "b", uri, env, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert_store_correct(tmp_path / "b", {uri: {"w.bin": data}}, must_have={uri})


def test_gcs_anonymous_fallback_reads_a_public_bucket(
    gcs_emulator: GCSServer, gcs_auth_front: GCSAuthFront, tmp_path: Path
) -> None:
    """No credentials anywhere (KServe: DefaultCredentialsError -> anonymous client): a public
    bucket is read unauthenticated."""
    front = gcs_auth_front
    bucket = gcs_emulator.new_bucket()
    gcs_emulator.client().bucket(bucket).blob("model/w.bin").upload_from_string(b"public" * 100)
    front.public.add(bucket)
    uri = f"gs://{bucket}/model"
    r = pull(tmp_path, uri, {"MODELCACHE_GCS_ENDPOINT": front.url, "GCE_METADATA_HOST": "127.0.0.1:9"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert_store_correct(tmp_path, {uri: {"w.bin": b"public" * 100}}, must_have={uri})
    assert not front.issued and front.authorized_requests >= 2


def test_azure_managed_identity_with_client_id(
    azurite_oauth: AzureServer,
    tls_pair: TLSPair,
    entra_token_server: EntraTokenServer,
    az_oauth_model: Any,
    tmp_path: Path,
) -> None:
    """AZURE_CLIENT_ID alone: a user-assigned managed identity (here App Service's endpoint,
    IDENTITY_ENDPOINT + IDENTITY_HEADER; AKS's IMDS address cannot be served locally)."""
    container, tree = az_oauth_model
    tokens = entra_token_server
    SECRETS.add(tokens.identity_header)
    uri = azurite_oauth.uri(container, "model")
    env = _azure_env(azurite_oauth, tls_pair, tokens) | {
        "AZURE_CLIENT_ID": tokens.client_id,
        "IDENTITY_ENDPOINT": f"{tokens.url}/msi/token",
        "IDENTITY_HEADER": tokens.identity_header,
    }
    r = pull(tmp_path / "a", uri, env | DEBUG)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_store_correct(tmp_path / "a", {uri: tree}, must_have={uri})
    assert tokens.grants and {(g["proof"], g["client_id"]) for g in tokens.grants} == {
        ("identity-header", tokens.client_id)
    }
    # Another identity's client id: the endpoint refuses, one line names the variables.
    fails_with(tmp_path / "b", uri, env | {"AZURE_CLIENT_ID": "00000000-0000-4000-8000-000000000000"}, "Azure AD", uri)
