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
from typing import Any

import pytest

from modelcache.kube.client import SECRETS, SERVICE_ACCOUNTS
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.agent_util import (
    create_node,
    create_secret,
    create_service_account,
    entry,
    kube_for,
    poll_while,
    start_agent,
    wait_states,
)
from tests.faultproxy import FaultProxy
from tests.fixtures.http import random_bytes
from tests.hfhub import HubServer

pytestmark = pytest.mark.timeout(480)
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


# ---- the switch-over rehearsal (issue 26) -------------------------------------------------------

NS = "team"
NODE_NAMES = ("n1", "n2")
GROUP_LABEL = {"kserve/localmodel": "worker"}
LOCALMODEL_LABEL = "internal.serving.kserve.io/localmodel"
VLLM = """apiVersion: serving.kserve.io/v1beta1
kind: InferenceService
metadata: {{name: vllm, namespace: {ns}}}
spec:
  predictor:
    containers:
    - name: kserve-container
      image: vllm/vllm-openai:v0.9.2
      args: [--model, /mnt/models, --max-model-len, "{max_len}"]
      env: [{{name: STORAGE_URI, value: '{uri}'}}]
"""


def _kserve_objects(kube: Any) -> None:
    """The Deployment and DaemonSet `modelcache migrate` looks for (KServe's local-model controller
    runs here as a process; its node agent's work is done by hand below)."""
    from modelcache.kube.migrate import DAEMON_SETS, DEPLOYMENTS

    def template(name: str) -> dict[str, Any]:
        return {"metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "manager", "image": f"kserve/{name}:v0.20.0"}]}}

    kube.create(DEPLOYMENTS, {"metadata": {"name": "kserve-localmodel-controller-manager"}, "spec": {
        "replicas": 1, "selector": {"matchLabels": {"app": "lmc"}}, "template": template("lmc")}}, "kserve")
    kube.create(DAEMON_SETS, {"metadata": {"name": "kserve-localmodelnode-agent"}, "spec": {
        "selector": {"matchLabels": {"app": "lmn"}}, "template": template("lmn")}}, "kserve")


def _isvc(cluster: Any, name: str, uri: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=(
        f"apiVersion: serving.kserve.io/v1beta1\nkind: InferenceService\nmetadata: {{name: {name}, namespace: {NS}}}\n"
        f"spec: {{predictor: {{model: {{modelFormat: {{name: sklearn}}, storageUri: '{uri}'}}}}}}\n"))


def test_the_switch_over_rehearsal_keeps_every_service_cached_and_placed(
    cluster: Any, coordinator_factory: Any, moto_s3: Any, hf_hub: HubServer, tmp_path: Path
) -> None:
    """A cluster KServe v0.20.0 runs (its controller manager, its local-model controller and CRDs;
    its node agent's work as that agent leaves it: `models/<storageKey>/` filled as its Jobs fill
    it, `ModelDownloaded` written), with one custom-container service (vLLM, `STORAGE_URI`), one
    mutable `hf://` source (its branch moved after the download), one model whose origin is gone,
    and one legacy bucket name (`Legacy_Models_...`), is switched following deploy/README.md:
    `modelcache migrate`, its commands, then our coordinator and agents (as processes with
    deploy/'s ServiceAccounts and webhooks registered by URL: no kubelet runs their pods here).

    Throughout: no service loses its cache labels (nor after an update), every node keeps its
    placement labels and every cache its two available copies, and a pod created while the copies
    are verified is placed at once. Then: 0 origin bytes of the verified models (S3 bodies through
    a counting proxy, the Hub's file GETs), the moved branch is drift (the folder was verified at
    its own commit, nothing rewritten), and the model whose origin is gone keeps serving,
    Unverified."""
    import json
    import subprocess

    from coordinator.nodelabels import model_label
    from modelcache.kube.client import INFERENCE_SERVICES, LOCAL_MODEL_CACHES, LOCAL_MODEL_NODES, NODES, PODS
    from tests.cluster.build import BIN
    from tests.coordinator_util import make_cache, make_group, make_namespace, register_webhooks
    from tests.helpers import REPO, free_port, wait_until
    from tests.kserve import controller as kserve
    from tests.pull_helpers import cli_cmd

    kserve.require_binary(kserve.MANAGER)
    kserve.require_binary(kserve.LOCAL_MODEL)
    kube = kube_for(cluster)
    crds = kserve.docs_of(kserve.LOCALMODEL_CRDS)
    kserve.apply(cluster, crds)  # KServe's LocalModel* CRDs, as its install leaves them (reset puts ours back)
    kserve.wait_established(cluster, crds)
    kserve.install(cluster, components=(kserve.MANAGER, kserve.LOCAL_MODEL))
    manager = kserve.start(cluster, tmp_path / "kserve", kserve.MANAGER)
    local_model = kserve.start(cluster, tmp_path / "kserve-lm", kserve.LOCAL_MODEL)
    agents: list[Any] = []
    s3proxy = None
    try:
        for node in NODE_NAMES:
            cluster.register_node(node, GROUP_LABEL)
        make_group(kube, "workers")
        make_namespace(kube, NS)
        _kserve_objects(kube)

        # The origins: a legacy us-east-1 bucket (upper case, underscores) behind a byte-counting
        # proxy; a Hub repo whose main moves after KServe's download; an HTTP origin that is gone.
        bucket = f"Legacy_Models_{os.urandom(3).hex()}"
        moto_s3.client().create_bucket(Bucket=bucket)
        for rel, data in S3_FILES.items():
            moto_s3.client().put_object(Bucket=bucket, Key=f"llama/{rel}", Body=data)
        host, port = moto_s3.endpoint.removeprefix("http://").split(":")
        s3proxy = FaultProxy((host, int(port)))
        repo = hf_hub.create_repo("org/mutable")
        repo.commit(HF_FILES, message="v1")
        commit_a = repo.branches["main"]
        s3_uri, hf_uri = f"s3://{bucket}/llama", "hf://org/mutable"
        onnx_uri = f"http://127.0.0.1:{free_port()}/onnx/model.onnx"  # nothing listens there any more
        onnx_bytes = random_bytes(1 << 20, 7)
        jobs = kserve.JOB_NAMESPACE
        # (key names as KServe's shipped inferenceservice-config names them: credentials.s3.s3*Name)
        kube.create(SECRETS, {"metadata": {"name": "s3", "annotations": {
            "serving.kserve.io/s3-endpoint": s3proxy.base_url}}, "stringData": {
            "AWS_ACCESS_KEY_ID": moto_s3.access_key, "AWS_SECRET_ACCESS_KEY": moto_s3.secret_key}}, jobs)
        kube.create(SERVICE_ACCOUNTS, {"metadata": {"name": "models"}, "secrets": [{"name": "s3"}]}, jobs)

        # The caches (through KServe's validator), and what KServe's controller and agent make of them.
        make_cache(kube, "llama", s3_uri, ["workers"], serviceAccountName="models")
        make_cache(kube, "mutable", hf_uri, ["workers"])
        make_cache(kube, "onnx", onnx_uri, ["workers"])
        caches = {"llama": s3_uri, "mutable": hf_uri, "onnx": onnx_uri}
        try:
            wait_until(lambda: all(len(((kube.get_or_none(LOCAL_MODEL_NODES, n) or {}).get("spec") or {}).get(
                "localModels") or []) == 3 for n in NODE_NAMES), timeout=90, what="KServe's LocalModelNodes")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{local_model.log()[-4000:]}") from None
        roots = {n: tmp_path / f"root-{n}" for n in NODE_NAMES}
        for node, root in roots.items():
            _fill_like_kserve(root, s3_uri, S3_FILES)
            _fill_like_kserve(root, hf_uri, {**HF_FILES, **{  # snapshot_download's own records of the commit
                f".cache/huggingface/download/{rel}.metadata": f"{commit_a}\n\"e\"\n1.0\n".encode()
                for rel in HF_FILES}})
            _fill_like_kserve(root, onnx_uri, {"model.onnx": onnx_bytes})
            kube.patch_status(LOCAL_MODEL_NODES, node, {"status": {"modelStatus": {name: D for name in caches}}})
        model_files = {s3_uri: list(S3_FILES), hf_uri: list(HF_FILES), onnx_uri: ["model.onnx"]}

        def model_inodes(node: str) -> dict[str, int]:
            """The inodes of the folders pods mount and of the model files in them."""
            out = {}
            for uri, names in model_files.items():
                folder = roots[node] / "models" / storage_key(uri)
                out[str(folder)] = folder.stat().st_ino
                out.update({str(folder / n): (folder / n).stat().st_ino for n in names})
            return out

        inodes = {n: model_inodes(n) for n in NODE_NAMES}

        def cache_status(name: str) -> dict[str, Any]:
            return dict(kube.get(LOCAL_MODEL_CACHES, name).get("status") or {})

        wait_until(lambda: all(cache_status(c).get("nodeStatus") == {n: "NodeDownloaded" for n in NODE_NAMES}
                               for c in caches), timeout=60, what="KServe's cache status: two copies each")
        repo.commit({"config.json": b'{"model_type": "tiny", "v": 2}\n'}, message="v2")  # main moves on

        # The services, labelled by KServe's defaulter.
        cluster.kubectl("apply", "-f", "-", input=VLLM.format(ns=NS, uri=s3_uri, max_len=4096))
        _isvc(cluster, "onnx", onnx_uri)
        _isvc(cluster, "mutable", hf_uri)
        services = {"vllm": "llama", "onnx": "onnx", "mutable": "mutable"}

        def service_metadata() -> dict[str, tuple[Any, Any]]:
            out = {}
            for svc in services:
                meta = kube.get(INFERENCE_SERVICES, svc, NS)["metadata"]
                out[svc] = ({k: v for k, v in (meta.get("labels") or {}).items() if "localmodel" in k},
                            {k: v for k, v in (meta.get("annotations") or {}).items() if "localmodel" in k})
            return out

        before = service_metadata()
        assert {svc: labels.get(LOCALMODEL_LABEL) for svc, (labels, _a) in before.items()} == services

        def pods(svc: str) -> list[dict[str, Any]]:
            return [p for p in kube.list(PODS, NS, label_selector=f"serving.kserve.io/inferenceservice={svc}")["items"]
                    if not p["metadata"].get("deletionTimestamp")]

        wait_until(lambda: all(pods(s) for s in services), timeout=120, what="the predictors' pods")

        # The switch, following deploy/README.md: migrate, then its commands. deploy/'s agent
        # DaemonSet carries the site's Hub endpoint (a mirror, here the test Hub) in its env: the
        # listings migrate makes start from it, as the agent's downloads will.
        from modelcache.kube.migrate import DAEMON_SETS

        kube.create(DAEMON_SETS, {"metadata": {"name": "modelcache-agent"}, "spec": {
            "selector": {"matchLabels": {"app": "a"}}, "template": {"metadata": {"labels": {"app": "a"}}, "spec": {
                "serviceAccountName": "modelcache-agent", "containers": [{"name": "agent", "image": "modelcache",
                                                                          "env": [{"name": "HF_ENDPOINT",
                                                                                   "value": hf_hub.url}]}]}}}},
                    "modelcache-system")
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PATH": f"{BIN}:{os.environ['PATH']}"}
        planned = subprocess.run([*cli_cmd(), "migrate", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=120)
        steps = json.loads(planned.stdout)["steps"]
        checks = [s["check"] for s in steps]
        assert checks[:3] == ["kserve-agent", "kserve-controller", "kserve-webhook"], checks
        assert {"crds", "credentials", "install", "sources"} <= set(checks), checks
        sources = [s["finding"] for s in steps if s["check"] == "sources"]  # listed as the agent will list
        assert len(sources) == 1 and sources[0].startswith("cache onnx:"), sources
        assert not [s for s in steps if s["check"] == "sources" and s["blocking"]]
        for step in steps:
            for command in step["commands"]:
                if command == "kubectl apply -k deploy/":
                    continue  # our coordinator and agents run as processes below (no kubelet here)
                done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=REPO, env=env,
                                      capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, f"{command}\n{done.stderr}"
        local_model.stop()  # what the scale to 0 did to its pod

        coord = coordinator_factory(cluster)
        labels = {model_label(uri) for uri in caches.values()}

        def node_labels(node: str) -> set[str]:
            return {k for k in kube.get(NODES, node)["metadata"].get("labels") or {} if k in labels}

        # From KServe's persisted ModelDownloaded: every copy placed before any agent of ours runs.
        wait_until(lambda: all(node_labels(n) == labels for n in NODE_NAMES), timeout=60, what="placement labels")
        register_webhooks(cluster, coord)

        def serving_unchanged() -> None:
            for node in NODE_NAMES:
                assert node_labels(node) == labels, (node, node_labels(node))
            for name in caches:
                status = cache_status(name)
                assert status.get("nodeStatus") == {n: "NodeDownloaded" for n in NODE_NAMES}, (name, status)
                assert (status.get("copies") or {}).get("available") == 2, (name, status)
            assert service_metadata() == before

        s3proxy.pause()  # the legacy bucket's verification waits here, mid-switch
        for node, root in roots.items():
            agents.append(start_agent(cluster.agent_kubeconfig, node, root, tmp_path, "--drift-check-interval", "2",
                                      "--download-env", f"HF_ENDPOINT={hf_hub.url}"))

        def details(node: str) -> dict[str, Any]:
            return dict((kube.get(LOCAL_MODEL_NODES, node).get("status") or {}).get("modelDetails") or {})

        poll_while(lambda: all((details(n).get("llama") or {}).get("verification") == "Verifying" for n in NODE_NAMES),
                   serving_unchanged, timeout=90)
        # Mid-verification: a new pod of each service is placed at once, and an update of the custom
        # container service keeps its labels (KServe's defaulter, then ours) and mounts the cache.
        for svc in services:
            for pod in pods(svc):
                kube.delete(PODS, pod["metadata"]["name"], NS)
        cluster.kubectl("apply", "-f", "-", input=VLLM.format(ns=NS, uri=s3_uri, max_len=8192))

        def placed() -> bool:
            serving_unchanged()
            fresh = {svc: pods(svc) for svc in services}
            return all(ps and all(p["spec"].get("nodeName") in NODE_NAMES for p in ps) for ps in fresh.values())

        poll_while(placed, lambda: None, timeout=120)
        for pod in pods("vllm"):
            claims = {v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["spec"]["volumes"]}
            assert "llama-workers" in claims, pod["spec"]["volumes"]
        # ... all while the legacy bucket's copies were not verified yet (its listing still held;
        # a listing that times out meanwhile leaves it Unverified, counted all the same).
        assert all((details(n).get("llama") or {}).get("verification") in ("Verifying", "Unverified")
                   for n in NODE_NAMES)

        s3proxy.resume()

        def settled() -> bool:
            for node in NODE_NAMES:
                d = details(node)
                if any("verification" in d.get(name, {}) for name in ("llama", "mutable")):
                    return False
                if (d.get("onnx") or {}).get("verification") != "Unverified" or not (d.get("mutable") or {}).get(
                        "drift"):
                    return False
            return True

        poll_while(settled, serving_unchanged, timeout=120)
        serving_unchanged()

        def verified_condition(name: str) -> dict[str, Any]:
            conditions = {c["type"]: c for c in cache_status(name).get("conditions") or []}
            return dict(conditions.get("CopiesVerified") or {})

        # The caches say it too: verified copies, and the ones counted on KServe's word.
        try:
            wait_until(lambda: verified_condition("llama").get("status") == "True"
                       and verified_condition("onnx").get("reason") == "Unverified", timeout=30,
                       what="the caches' CopiesVerified conditions")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}: llama {cache_status('llama')}, onnx {cache_status('onnx')}, "
                                 f"n1 {kube.get(LOCAL_MODEL_NODES, 'n1').get('status')}") from None
        assert verified_condition("onnx")["status"] == "False" and "n1" in verified_condition("onnx")["message"]
        s3_bodies = {p: n for p, n in s3proxy.bytes_sent.items() if p.startswith(f"/{bucket}/llama/") and n}
        hf_gets = hf_hub.count(origin="cdn", method="GET") + hf_hub.count(origin="hub", method="GET",
                                                                          contains="/resolve/")
        print(f"origin bytes of the verified models: s3 {sum(s3_bodies.values())}, hf file GETs {hf_gets}")
        assert s3_bodies == {} and hf_gets == 0
        for node in NODE_NAMES:
            store = NodeStore.at(roots[node])
            for uri in (s3_uri, hf_uri):
                assert store.is_present(storage_key(uri)) and store.verify(storage_key(uri)) == []
            assert store.manifest(storage_key(hf_uri)).revision == commit_a  # verified at its own commit
            assert not store.is_present(storage_key(onnx_uri))  # not verified: its origin is gone ...
            d = details(node)
            status = kube.get(LOCAL_MODEL_NODES, node)["status"]
            assert status["modelStatus"] == {name: D for name in caches}  # ... and it keeps serving
            assert "revision" in d["mutable"]["drift"] and "config.json" in d["mutable"]["drift"]
            assert "onnx" in next(c for c in status["conditions"] if c["type"] == "ModelsVerified")["message"]
            # Nothing rewritten or moved under the pods (huggingface_hub's records, not the model,
            # were set aside: the integrity rules).
            assert model_inodes(node) == inodes[node]
            assert (roots[node] / "models" / storage_key(hf_uri) / "config.json").read_bytes() == \
                HF_FILES["config.json"]
    finally:
        for agent in agents:
            agent.stop()
        if s3proxy is not None:
            s3proxy.resume()
            s3proxy.close()
        local_model.stop()
        manager.stop()
