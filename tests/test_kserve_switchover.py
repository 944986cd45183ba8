"""Switching a node from KServe's agent to ours: its node root is kept as it is.

The node root is filled the way KServe's download Jobs leave it: ``models/<storageKey>/`` with the
model's files (plus what ``huggingface_hub`` writes beside them), no manifest. Our agent, started
on the real control plane with deploy/'s RBAC, reports every model Downloaded, and not one byte of
any model is read from its origin (S3 behind a byte-counting proxy, nginx's access log, the test
Hub's request log)."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import pytest

from modelcache.store import NodeStore
from modelcache.uri import storage_key
from tests.agent_util import (
    create_node,
    create_secret,
    create_service_account,
    entry,
    kube_for,
    start_agent,
    wait_states,
)
from tests.faultproxy import FaultProxy
from tests.fixtures.http import random_bytes
from tests.hfhub import HubServer

pytestmark = pytest.mark.timeout(240)
D = "ModelDownloaded"

S3_FILES = {"config.json": b'{"arch": "llama"}', "model-00001-of-00002.safetensors": random_bytes(3 << 20, 1),
            "model-00002-of-00002.safetensors": random_bytes(2 << 20, 2), "tokenizer/tokenizer.json": b"{}" * 500}
HF_FILES = {"config.json": b'{"model_type": "tiny"}\n', "model.safetensors": os.urandom(700 * 1024),
            "tokenizer/vocab.txt": b"a\nb\n" * 100}


def _fill_like_kserve(root: Path, uri: str, files: dict[str, bytes]) -> Path:
    folder = root / "models" / storage_key(uri)
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


def test_a_node_root_kserve_filled_is_adopted_with_zero_origin_bytes(cluster, moto_s3, nginx, hf_hub: HubServer,
                                                                     tmp_path):
    kube = kube_for(cluster)
    cluster.register_node("gpu-1")
    # The origins: S3 (moto, behind a proxy that counts body bytes per path), HTTP (nginx, with
    # the file's sha-256 in Repr-Digest), Hugging Face (the test Hub).
    bucket = moto_s3.new_bucket()
    for rel, data in S3_FILES.items():
        moto_s3.client().put_object(Bucket=bucket, Key=f"llama/{rel}", Body=data)
    http_data = random_bytes(4 << 20, 5)
    digest = base64.b64encode(hashlib.sha256(http_data).digest()).decode()
    nginx.write("onnx/model.onnx", http_data, headers={"Repr-Digest": f"sha-256=:{digest}:"})
    hf_hub.create_repo("org/tiny").commit(HF_FILES, message="init")
    host, port = moto_s3.endpoint.removeprefix("http://").split(":")
    with FaultProxy((host, int(port))) as proxy:
        s3_uri, http_uri, hf_uri = f"s3://{bucket}/llama", nginx.url("onnx/model.onnx"), "hf://org/tiny"
        create_secret(kube, "s3", {"awsAccessKeyID": moto_s3.access_key, "awsSecretAccessKey": moto_s3.secret_key},
                      annotations={"serving.kserve.io/s3-endpoint": proxy.base_url})
        create_service_account(kube, "models", ["s3"])

        # What KServe's agent and its Jobs leave on the node.
        root = tmp_path / "root"
        _fill_like_kserve(root, s3_uri, S3_FILES)
        _fill_like_kserve(root, http_uri, {"model.onnx": http_data})
        hf_folder = _fill_like_kserve(root, hf_uri, {
            **HF_FILES, ".cache/huggingface/download/config.json.metadata": b"abc\n123\n"})
        inodes = {p: p.stat().st_ino for p in (root / "models").iterdir()}

        create_node(kube, "gpu-1", [entry("llama", s3_uri, serviceAccountName="models"),
                                    entry("onnx", http_uri), entry("tiny", hf_uri, namespace="team")])
        agent = start_agent(cluster.agent_kubeconfig, "gpu-1", root, tmp_path,
                            "--download-env", f"HF_ENDPOINT={hf_hub.url}")
        try:
            status = wait_states(kube, "gpu-1", {"llama": D, "onnx": D, "team/tiny": D}, agent=agent)
        finally:
            agent.stop()
        s3_bodies = {p: n for p, n in proxy.bytes_sent.items() if p.startswith(f"/{bucket}/llama/") and n}

    http_bodies = sum(e.bytes_sent for e in nginx.requests_for("onnx/model.onnx") if e.range != "bytes=0-0")
    hf_gets = hf_hub.count(origin="cdn", method="GET") + hf_hub.count(origin="hub", method="GET",
                                                                      contains="/resolve/")
    print(f"origin bytes of the models: s3 {sum(s3_bodies.values())}, http {http_bodies}, hf file GETs {hf_gets}")
    assert s3_bodies == {} and http_bodies == 0 and hf_gets == 0
    assert {p: p.stat().st_ino for p in (root / "models").iterdir()} == inodes  # the folders pods mount
    store = NodeStore.at(root)
    for uri in (s3_uri, http_uri, hf_uri):
        assert store.is_present(storage_key(uri)) and store.verify(storage_key(uri)) == []
    # Verified by the sources' checksums (S3 MD5 ETags, the HTTP Repr-Digest, HF sha256/git sha1).
    assert all(f.checksums for uri in (s3_uri, http_uri, hf_uri) for f in store.manifest(storage_key(uri)).files)
    # Not the model (huggingface_hub's download metadata): moved out of the folder pods read, kept.
    assert not (hf_folder / ".cache").exists()
    moved = list((root / ".modelcache" / "unlisted" / storage_key(hf_uri)).rglob("config.json.metadata"))
    assert [p.read_bytes() for p in moved] == [b"abc\n123\n"]
    assert status["modelDetails"]["llama"]["bytesTotal"] == sum(len(v) for v in S3_FILES.values())
    assert agent.log().count('msg="adopting a model folder that has no manifest"') == 3
