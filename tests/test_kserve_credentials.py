"""KServe's credential rules, for the agent (as its download Job gets them) and the initializer (as
its env arrives), against the real control plane and the object-store test server:

- S3 settings kept in a Secret's data under the environment variable's own name (S3_ENDPOINT,
  S3_USE_HTTPS, AWS_DEFAULT_REGION, ...), which MinIO/Ceph users do;
- the ``credentials`` block of KServe's inferenceservice-config (S3 defaults, key names, the
  storage-spec secret's name);
- a CA bundle ConfigMap without cabundle.crt fails S3 only.
"""

from __future__ import annotations

import json

import pytest

from modelcache.kube.client import CONFIG_MAPS
from modelcache.sources.uri import storage_key
from tests.agent_util import (
    create_node,
    create_secret,
    create_service_account,
    ensure_namespace,
    entry,
    kube_for,
    model_files,
    node_status,
    start_agent,
    wait_states,
)
from tests.fixtures.http import random_bytes
from tests.initializer_util import run_initializer

pytestmark = pytest.mark.timeout(180)
D = "ModelDownloaded"


@pytest.fixture
def kube(cluster):
    cluster.register_node("node-a")
    return kube_for(cluster)


def _bucket_with_model(moto_s3) -> tuple[str, bytes]:
    bucket = moto_s3.new_bucket()
    body = random_bytes(1 << 20, 3)
    moto_s3.client().put_object(Bucket=bucket, Key="m/model.bin", Body=body)
    return bucket, body


def test_s3_settings_in_the_secret_data_under_their_env_names(cluster, kube, moto_s3, tmp_path):
    """No annotation: the endpoint, scheme and region are data keys of the secret (KServe reads them
    there after the annotations); without them the download went to AWS."""
    bucket, _ = _bucket_with_model(moto_s3)
    create_secret(kube, "minio", {"awsAccessKeyID": moto_s3.access_key, "awsSecretAccessKey": moto_s3.secret_key,
                                  "S3_ENDPOINT": moto_s3.endpoint.removeprefix("http://"), "S3_USE_HTTPS": "0",
                                  "AWS_DEFAULT_REGION": moto_s3.region})
    create_service_account(kube, "minio-sa", ["minio"])
    uri = f"s3://{bucket}/m"
    create_node(kube, "node-a", [entry("m", uri, serviceAccountName="minio-sa")])
    agent = start_agent(cluster.agent_kubeconfig, "node-a", tmp_path / "root", tmp_path)
    try:
        wait_states(kube, "node-a", {"m": D}, agent=agent)
    finally:
        agent.stop()
    assert model_files(tmp_path / "root", storage_key(uri)) == {"model.bin": 1 << 20}
    assert moto_s3.secret_key not in agent.log()


def test_the_credentials_block_of_inferenceservice_config(cluster, kube, moto_s3, tmp_path):
    """Cluster-wide defaults: the S3 endpoint, scheme and region, custom key names for the keys,
    and the storage-spec secret's name, from KServe's ConfigMap (read by name, deploy/'s RBAC)."""
    bucket, _ = _bucket_with_model(moto_s3)
    ensure_namespace(kube, "kserve")
    kube.create(CONFIG_MAPS, {"metadata": {"name": "inferenceservice-config"}, "data": {"credentials": json.dumps({
        "s3": {"s3AccessKeyIDName": "accessKey", "s3SecretAccessKeyName": "secretKey",
               "s3Endpoint": moto_s3.endpoint.removeprefix("http://"), "s3UseHttps": "0", "s3Region": moto_s3.region},
        "storageSpecSecretName": "team-storage"})}}, "kserve")
    create_secret(kube, "keys", {"accessKey": moto_s3.access_key, "secretKey": moto_s3.secret_key})
    create_service_account(kube, "keys-sa", ["keys"])
    create_secret(kube, "team-storage", {"s3": json.dumps({
        "type": "s3", "access_key_id": moto_s3.access_key, "secret_access_key": moto_s3.secret_key,
        "endpoint_url": moto_s3.endpoint, "region": moto_s3.region})})
    uri, uri2 = f"s3://{bucket}/m", f"s3://{bucket}/m/model.bin"
    create_node(kube, "node-a", [entry("viasa", uri, serviceAccountName="keys-sa"),
                                 entry("viaspec", uri2, storage={"key": "s3"})])
    agent = start_agent(cluster.agent_kubeconfig, "node-a", tmp_path / "root", tmp_path)
    try:
        wait_states(kube, "node-a", {"viasa": D, "viaspec": D}, agent=agent)
    finally:
        agent.stop()
    assert model_files(tmp_path / "root", storage_key(uri)) == {"model.bin": 1 << 20}
    assert model_files(tmp_path / "root", storage_key(uri2)) == {"model.bin": 1 << 20}


def test_without_the_kserve_config_map_the_defaults_apply(cluster, kube, moto_s3, tmp_path):
    """No KServe installed: no ConfigMap, KServe's built-in key names; the entry's own secret works."""
    bucket, _ = _bucket_with_model(moto_s3)
    create_secret(kube, "plain", {"awsAccessKeyID": moto_s3.access_key, "awsSecretAccessKey": moto_s3.secret_key},
                  annotations={"serving.kserve.io/s3-endpoint": moto_s3.endpoint})
    create_service_account(kube, "plain-sa", ["plain"])
    uri = f"s3://{bucket}/m"
    create_node(kube, "node-a", [entry("m", uri, serviceAccountName="plain-sa")])
    agent = start_agent(cluster.agent_kubeconfig, "node-a", tmp_path / "root", tmp_path)
    try:
        status = wait_states(kube, "node-a", {"m": D}, agent=agent)
    finally:
        agent.stop()
    assert status["modelDetails"]["m"]["bytesTotal"] == 1 << 20
    assert "forbidden" not in agent.log() and node_status(kube, "node-a")["modelStatus"] == {"m": D}


def test_a_missing_ca_bundle_fails_s3_and_warns_for_the_rest(nginx, moto_s3, tmp_path):
    """KServe's initializer: CA_BUNDLE_CONFIGMAP_NAME set, no cabundle.crt mounted: S3 fails with
    "Failed to find ca bundle file", every other backend keeps the default trust store."""
    bucket, _ = _bucket_with_model(moto_s3)
    nginx.write("h/model.bin", 4096)
    env = {**moto_s3.env(), "CA_BUNDLE_CONFIGMAP_NAME": "cabundle",
           "CA_BUNDLE_VOLUME_MOUNT_POINT": str(tmp_path / "not-mounted")}
    env.pop("AWS_ENDPOINT_URL")
    env["S3_ENDPOINT"], env["S3_USE_HTTPS"] = moto_s3.endpoint.removeprefix("http://"), "0"
    r = run_initializer(f"s3://{bucket}/m", tmp_path / "s3", nginx.url("h/model.bin"), tmp_path / "http", env=env)
    assert r.code == 1
    errors = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"s3://{bucket}/m" in errors[0] and "Failed to find ca bundle file(" in errors[0]
    assert (tmp_path / "http" / "model.bin").stat().st_size == 4096
    assert "not found" in r.err and "default trust store" in r.err


def test_hdfs_storage_spec_file_secrets_are_base64_as_in_kserve(tmp_path):
    """KServe's storage spec of type hdfs: TLS_CERT, TLS_KEY, TLS_CA and KERBEROS_KEYTAB are base64
    in the JSON and written decoded (written as given, TLS failed). Against the WebHDFS test server
    on HTTPS demanding a client certificate."""
    import base64
    import os

    from tests.fixtures.http import make_tls
    from tests.test_hdfs_source import _client_cert
    from tests.webhdfs import WebHDFSServer

    tls = make_tls(tmp_path / "server-tls")
    client_ca, client_cert, client_key = _client_cert(tmp_path / "client-tls")
    server = WebHDFSServer(root=tmp_path / "ns", tls_cert=tls.cert_path, tls_key=tls.key_path,
                           client_ca=client_ca).start()
    try:
        data = os.urandom(200_000)
        server.put("/models/m/w.bin", data)

        def b64(path):
            return base64.b64encode(path.read_bytes()).decode()

        spec = {"type": "hdfs", "HDFS_NAMENODE": server.url, "TLS_CA": b64(tls.ca_path),
                "TLS_CERT": b64(client_cert), "TLS_KEY": b64(client_key)}
        r = run_initializer("hdfs://models/m", tmp_path / "dest", env={"STORAGE_CONFIG": json.dumps(spec)})
        assert r.code == 0, r.output
        assert (tmp_path / "dest" / "w.bin").read_bytes() == data
        # A PEM pasted as is (not base64): one line naming the key and the fix.
        bad = {**spec, "TLS_CA": tls.ca_path.read_text()}
        r = run_initializer("hdfs://models/m", tmp_path / "d2", env={"STORAGE_CONFIG": json.dumps(bad)})
        assert r.code == 1 and "TLS_CA is not base64" in r.err and "BEGIN CERTIFICATE" not in r.err
    finally:
        server.stop()
