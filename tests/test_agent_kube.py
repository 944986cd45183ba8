"""The node agent as a subprocess against the kube test server and real storage servers."""

from __future__ import annotations

import json
import re
import time

import pytest

from agent.capacity import allocated_bytes
from modelcache.kube.client import LOCAL_MODEL_NODES
from modelcache.sources.uri import storage_key
from tests.agent_util import (
    create_node,
    create_secret,
    create_service_account,
    entry,
    kube_for,
    model_files,
    node_status,
    set_entries,
    start_agent,
    wait_states,
)
from tests.fixtures.http import random_bytes
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(180)

D = "ModelDownloaded"


@pytest.fixture
def kube(cluster):
    for node in ("node-a", "node-b"):
        cluster.register_node(node)
    return kube_for(cluster)


def test_two_backends_with_credentials_status_metrics_and_no_secret_in_logs(cluster, kube, nginx, moto_s3, tmp_path):
    # HTTP (nginx): one file. S3 (moto, IAM auth on): the same prefix reached twice, once with the
    # storage-config secret (storage.key) and once through a service account's secret.
    nginx.write("m/model.bin", 3 << 20)
    s3 = moto_s3.client()
    bucket = moto_s3.new_bucket()
    objects = {"llm/config.json": b'{"a": 1}', "llm/weights/model-1.safetensors": random_bytes(2 << 20, 7)}
    for k, body in objects.items():
        s3.put_object(Bucket=bucket, Key=k, Body=body)
    s3.put_object(Bucket=bucket, Key="sa/model.bin", Body=random_bytes(1 << 20, 9))

    spec_cfg = {"type": "s3", "access_key_id": moto_s3.access_key, "secret_access_key": moto_s3.secret_key,
                "endpoint_url": moto_s3.endpoint, "region": "us-east-1"}
    # The key is granted to namespace team (its namespace cache below names it: docs/install.md#credentials).
    create_secret(kube, "storage-config", {"localS3": json.dumps(spec_cfg)},
                  annotations={"namespaces.modelcache.io/localS3": "team"})
    host = moto_s3.endpoint.removeprefix("http://")
    create_secret(kube, "s3creds", {"awsAccessKeyID": moto_s3.access_key, "awsSecretAccessKey": moto_s3.secret_key},
                  annotations={"serving.kserve.io/s3-endpoint": host, "serving.kserve.io/s3-usehttps": "0",
                               "serving.kserve.io/s3-region": "us-east-1"})
    create_service_account(kube, "models-sa", ["s3creds"])

    http_uri, s3_uri, sa_uri = nginx.url("m/model.bin"), f"s3://{bucket}/llm", f"s3://{bucket}/sa"
    create_node(kube, "node-a", [
        entry("web", http_uri),
        entry("llm", s3_uri, storage={"key": "localS3"}),
        entry("llm", s3_uri, namespace="team", storage={"key": "localS3"}),  # same URI: one folder
        entry("viasa", sa_uri, serviceAccountName="models-sa"),
    ])
    agent = start_agent(cluster.agent_kubeconfig, "node-a", tmp_path / "root", tmp_path)
    try:
        status = wait_states(kube, "node-a", {"web": D, "llm": D, "team/llm": D, "viasa": D}, agent=agent)
        root = tmp_path / "root"
        assert model_files(root, storage_key(http_uri)) == {"model.bin": 3 << 20}
        assert model_files(root, storage_key(s3_uri)) == {"config.json": 8, "weights/model-1.safetensors": 2 << 20}
        assert model_files(root, storage_key(sa_uri)) == {"model.bin": 1 << 20}
        assert sorted(p.name for p in (root / "models").iterdir()) == sorted(
            {storage_key(u) for u in (http_uri, s3_uri, sa_uri)})

        d = status["modelDetails"]["llm"]
        assert d["state"] == D and d["storageKey"] == storage_key(s3_uri) and d["sourceModelUri"] == s3_uri
        assert d["bytesTotal"] == d["bytesDone"] == (2 << 20) + 8 and d["filesTotal"] == 2
        assert d["startedAt"] and d["finishedAt"] and d["attempts"] == 1
        assert status["modelDetails"]["team/llm"]["storageKey"] == d["storageKey"]
        assert status["modelCounts"] == {"downloaded": 4, "downloading": 0, "pending": 0, "failed": 0, "total": 4}
        cap = status["capacity"]
        assert cap["totalBytes"] > 0 and 0 < cap["freeBytes"] <= cap["totalBytes"] and cap["free"]
        assert status.get("lastUpdated")

        code, text = agent.get("/metrics")
        assert code == 200
        assert 'modelcache_agent_models{state="ModelDownloaded"} 4.0' in text  # by status key, as modelStatus
        assert 'modelcache_agent_downloaded_bytes_total{scheme="http"} 3.145728e+06' in text
        assert 'modelcache_agent_downloaded_bytes_total{scheme="s3"}' in text
        assert "modelcache_agent_download_duration_seconds_count" in text
        assert "modelcache_agent_free_bytes" in text and "modelcache_agent_reserved_bytes 0.0" in text
        assert agent.get("/healthz")[0] == 200 and agent.get("/readyz")[0] == 200
    finally:
        agent.stop()
    logs = agent.log()
    assert "download finished" in logs
    for secret in (moto_s3.secret_key, moto_s3.access_key):
        assert secret not in logs
        assert secret not in json.dumps(node_status(kube, "node-a"))


def test_wrong_storage_key_is_an_error_without_the_secret(cluster, kube, moto_s3, tmp_path):
    bucket = moto_s3.new_bucket()
    moto_s3.client().put_object(Bucket=bucket, Key="p/f.bin", Body=b"x" * 1000)
    bad = {"type": "s3", "access_key_id": "AKIAWRONGWRONGWRONG", "secret_access_key": "wrong-secret-value-123",
           "endpoint_url": moto_s3.endpoint, "region": "us-east-1"}
    create_secret(kube, "storage-config", {"bad": json.dumps(bad)})
    create_node(kube, "node-a", [entry("m", f"s3://{bucket}/p", storage={"key": "bad"}),
                                 entry("nokey", f"s3://{bucket}/p/", storage={"key": "missing"})])
    agent = start_agent(cluster.agent_kubeconfig, "node-a", tmp_path / "root", tmp_path)
    try:
        status = wait_states(kube, "node-a", {"m": "ModelDownloadError", "nokey": "ModelDownloadError"}, agent=agent)
        assert "no key 'missing'" in status["modelDetails"]["nokey"]["message"]
        assert status["modelDetails"]["m"]["message"]
    finally:
        agent.stop()
    assert "wrong-secret-value-123" not in agent.log()
    assert "wrong-secret-value-123" not in json.dumps(node_status(kube, "node-a"))


def test_two_agents_two_nodes_two_roots(cluster, kube, nginx, own_fs, tmp_path):
    nginx.write("x/model.bin", 1 << 20)
    nginx.write("y/model.bin", 1 << 20)
    ux, uy = nginx.url("x/model.bin"), nginx.url("y/model.bin")
    create_node(kube, "node-a", [entry("x", ux)])
    create_node(kube, "node-b", [entry("y", uy)])
    # Roots on a file system of the test's own: "no more writes" below must not see a write
    # caused by another process moving the free bytes of a shared disk (tests/fixtures/filesystems.py).
    ra, rb = own_fs / "ra", own_fs / "rb"
    a = start_agent(cluster.agent_kubeconfig, "node-a", ra, tmp_path)
    b = start_agent(cluster.agent_kubeconfig, "node-b", rb, tmp_path)
    try:
        wait_states(kube, "node-a", {"x": D}, agent=a)
        wait_states(kube, "node-b", {"y": D}, agent=b)
        assert sorted(p.name for p in (ra / "models").iterdir()) == [storage_key(ux)]
        assert sorted(p.name for p in (rb / "models").iterdir()) == [storage_key(uy)]
        assert set(node_status(kube, "node-a")["modelStatus"]) == {"x"}
        # Settled: no more writes (the status interval is 0.5 s, so several ticks pass here).
        rv = kube.get(LOCAL_MODEL_NODES, "node-a")["metadata"]["resourceVersion"]
        time.sleep(2.5)
        assert kube.get(LOCAL_MODEL_NODES, "node-a")["metadata"]["resourceVersion"] == rv
        assert set(node_status(kube, "node-b")["modelStatus"]) == {"y"}
        # A change to one node touches only that node's root.
        set_entries(kube, "node-b", [])
        wait_until(lambda: not any((rb / "models").iterdir()), timeout=20, what="node-b emptied")
        assert model_files(ra, storage_key(ux)) == {"model.bin": 1 << 20}
        assert node_status(kube, "node-a")["modelStatus"] == {"x": D}
    finally:
        a.stop()
        b.stop()


def test_entry_removed_mid_download_cancels_and_cleans_up(cluster, kube, nginx, fault_proxy, tmp_path):
    # Through the fault proxy, held still once under way: on a loaded machine a merely slow download
    # could finish before the entry is removed (the test then saw a published model and flaked).
    nginx.write("slow/model.bin", 4 << 20)
    fault_proxy.set_rate_limit(400_000)
    uri = fault_proxy.url("slow/model.bin")
    key, root = storage_key(uri), tmp_path / "root"
    create_node(kube, "node-a", [entry("m", uri)])
    agent = start_agent(cluster.agent_kubeconfig, "node-a", root, tmp_path)
    try:
        def under_way() -> bool:
            d = node_status(kube, "node-a").get("modelDetails", {}).get("m", {})
            return d.get("state") == "ModelDownloading" and (d.get("bytesDone") or 0) > 0

        wait_until(under_way, timeout=60, what="download under way")
        fault_proxy.pause()  # the download cannot end on its own from here on
        assert (root / ".modelcache" / "staging" / key).is_dir()
        set_entries(kube, "node-a", [])
        wait_until(lambda: "download stopped: model left the spec" in agent.log(), timeout=30, what="cancelled")
        wait_until(lambda: not (root / ".modelcache" / "staging" / key).exists(), timeout=30, what="staging gone")
        assert not (root / "models" / key).exists()
        wait_until(lambda: node_status(kube, "node-a").get("modelStatus") == {}
                   and not node_status(kube, "node-a").get("modelDetails"), timeout=30, what="status cleared")
        assert "model deleted" in agent.log()
    finally:
        fault_proxy.resume()
        agent.stop()


def test_restarted_agent_keeps_downloaded_models_without_fetching(cluster, kube, nginx, tmp_path):
    nginx.write("k/model.bin", 1 << 20)
    uri = nginx.url("k/model.bin")
    create_node(kube, "node-a", [entry("m", uri)])
    agent = start_agent(cluster.agent_kubeconfig, "node-a", tmp_path / "root", tmp_path)
    try:
        wait_states(kube, "node-a", {"m": D}, agent=agent)
    finally:
        agent.stop()
    nginx.clear_access_log()
    again = start_agent(cluster.agent_kubeconfig, "node-a", tmp_path / "root", tmp_path, name="again")
    try:
        wait_until(lambda: "model present" in again.log(), timeout=20, what="restart")
        wait_until(lambda: again.get("/readyz")[0] == 200, timeout=20, what="ready after the first sync")
        time.sleep(1)
        assert node_status(kube, "node-a")["modelStatus"] == {"m": D}
    finally:
        again.stop()
    assert nginx.access_log() == [] and "download started" not in again.log()


def test_status_written_on_change_and_progress_at_most_once_per_interval(cluster, kube, nginx, fault_proxy,
                                                                         own_fs, tmp_path):
    from modelcache.kube.informer import Informer

    nginx.write("p/model.bin", 3 << 20)
    fault_proxy.set_rate_limit(350_000)  # ~9 s of download
    uri = fault_proxy.url("p/model.bin")
    create_node(kube, "node-a", [entry("m", uri)])
    writes: list[tuple[float, str, int]] = []
    reserved: list[int | None] = []

    def seen(event: str, obj: dict, _old: dict | None) -> None:
        st = obj.get("status") or {}
        if event == "MODIFIED" and st.get("modelStatus"):
            writes.append((time.monotonic(), st["modelStatus"].get("m", ""),
                           (st.get("modelDetails", {}).get("m") or {}).get("bytesDone") or 0))
            reserved.append((st.get("capacity") or {}).get("reservedBytes"))

    watcher = Informer(kube, LOCAL_MODEL_NODES, field_selector="metadata.name=node-a")
    watcher.add_handler(seen)
    watcher.start()
    # The root on a file system of its own: the status carries its free bytes, written again when
    # they move by 1 GiB; on the shared disk other work moved them that much within this test and
    # "Downloaded" was written twice (tests/fixtures/filesystems.py).
    root = own_fs / "root"
    agent = start_agent(cluster.agent_kubeconfig, "node-a", root, tmp_path, "--status-interval", "2")
    try:
        def metric(name: str) -> float:
            m = re.search(rf"^{name} (\S+)$", agent.get("/metrics")[1], re.M)
            return float(m.group(1)) if m else -1.0

        # Held still mid-download: what the model still needs is reserved (metrics and status) and
        # what its staged files already hold is not counted again, then the reservation is released.
        wait_until(lambda: any(w[1] == "ModelDownloading" and w[2] > 0 for w in writes), timeout=60,
                   what="download under way")
        fault_proxy.pause()
        staged = root / ".modelcache" / "staging" / storage_key(uri)
        try:
            wait_until(lambda: metric("modelcache_agent_reserved_bytes") + allocated_bytes(staged) >= 3 << 20,
                       timeout=20, what="reserved gauge")
            assert metric("modelcache_agent_reserved_bytes") <= 3 << 20
            assert metric("modelcache_agent_free_bytes") > 0
        finally:
            fault_proxy.resume()
        wait_states(kube, "node-a", {"m": D}, agent=agent, timeout=90)
        wait_until(lambda: metric("modelcache_agent_reserved_bytes") == 0, timeout=20, what="reservation released")
        time.sleep(1)
    finally:
        agent.stop()
        watcher.stop()
    downloading = [w for w in writes if w[1] == "ModelDownloading"]
    progress = sorted({w[2] for w in downloading})
    assert len(progress) >= 3, writes  # progress is reported while the download runs...
    span = downloading[-1][0] - downloading[0][0]
    # ...but at most once per --status-interval (plus the start and the admission, which are changes).
    assert len(downloading) <= span / 2 + 3, (len(downloading), span, writes)
    assert [w[1] for w in writes].count(D) == 1, writes  # Downloaded written once, then nothing
    assert all(r is None or 0 <= r <= 3 << 20 for r in reserved) and reserved[-1] == 0, reserved
