#!/usr/bin/env python3
"""Benchmark: time to a Ready serving pod on a real node (issue 24, item 7).

One real node (tests/cluster/realnodes.py: a kubelet and a containerd on this machine), a model
of safetensors shards (default 2 GiB) in SeaweedFS on the node network's host address, behind a
relay that counts the bytes the origin sends. For each variant, side by side and in a rotating
order, a predictor pod is created as KServe's Deployment makes it and timed until it is Ready:

  (a) KServe's storage initializer as the init container: an image built here from the
      `kserve-storage` package on PyPI (the release of the KServe the tests run, v0.20.0), as
      KServe's own Dockerfile builds it from its package, as user 1000, with an entrypoint of
      ours that calls `Storage.download(src, dest)` per pair as KServe's does;
  (b) ours as the init container (the project image, `make image`);
  (c) the model already on the node, as the cache gives it: a `local` PersistentVolume at the
      node folder and its claim, mounted read-only with subPath `models/<storageKey>` (KServe's
      local-model rewrite);
  (d) the same serving pod with no model at all.

Both init containers get the S3 environment KServe's injector gives them and the resources of
KServe's `storageInitializer` config (1 CPU, 1 GiB). The serving container
(tests/cluster/runtime/cmd/serve, `--digest=none`) reads every byte of the model before it says
Ready, as a model server loads its weights. Ready is taken from a watch of the pod (no polling
processes beside the pods). Prints the median of the rounds, the ratios (targets: b <= 0.5 x a;
c <= 1.2 x d), origin bytes per variant and the load.

    sudo .venv/bin/python bench/podstart.py                      # 2 GiB, 3 rounds
    sudo .venv/bin/python bench/podstart.py --size 256MiB --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modelcache.runtime.sizes import parse_size  # noqa: E402
from tests.cluster.images import podman_archive, project_image, static_image  # noqa: E402
from tests.cluster.realnodes import RealNodes  # noqa: E402
from tests.counting_relay import CountingRelay  # noqa: E402
from tests.fixtures.seaweedfs import ACCESS_KEY, SECRET_KEY, start_seaweedfs  # noqa: E402
from tests.node_util import safetensors  # noqa: E402
from tests.realnodes_util import local_volume  # noqa: E402

KSERVE_STORAGE = "kserve-storage==0.20.0"
KSERVE_IMAGE = "localhost/modelcache-bench/kserve-storage-initializer:0.20.0"
CONTAINERS_CONF = REPO / ".work" / "image" / "containers.conf"
#: Our entrypoint for KServe's package: what KServe's initializer-entrypoint does (pairs of
#: SRC DEST, each `Storage.download`), written here: KServe's own files are not copied.
KSERVE_ENTRYPOINT = """\
import sys
from kserve_storage import Storage
args = sys.argv[1:]
for src, dest in zip(args[::2], args[1::2]):
    Storage.download(src, dest)
"""


def podman(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    return subprocess.run(["podman", *args], env=env, text=True, capture_output=True, **kw)


def kserve_image(base: str) -> str:
    """KServe's storage initializer from its PyPI package, on the same base as ours."""
    if podman("image", "exists", KSERVE_IMAGE).returncode == 0:
        return KSERVE_IMAGE
    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "entrypoint.py").write_text(KSERVE_ENTRYPOINT)
        Path(ctx, "Containerfile").write_text(
            f"FROM {base}\nRUN python3 -m venv /opt/kserve && /opt/kserve/bin/pip install -q {KSERVE_STORAGE}\n"
            "COPY entrypoint.py /opt/kserve/entrypoint.py\n"
            "USER 1000\n"
            'ENTRYPOINT ["/opt/kserve/bin/python", "/opt/kserve/entrypoint.py"]\n')
        proc = podman("build", "--pull=never", "--network", "host", "-v", "/etc/ssl/certs:/etc/ssl/certs:ro",
                      "-t", KSERVE_IMAGE, ctx)
        if proc.returncode != 0:
            sys.exit(f"building {KSERVE_IMAGE} failed:\n{proc.stderr[-3000:]}")
    return KSERVE_IMAGE


def make_model(origin: str, size: int, shards: int) -> tuple[int, list[str]]:
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=origin, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
                      aws_secret_access_key=SECRET_KEY, config=Config(s3={"addressing_style": "path"}))
    s3.create_bucket(Bucket="models")
    names, total = [], 0
    per = size // shards
    for i in range(shards):
        data = safetensors({f"layer{i}": ("F32", [per // 4 // 1024, 1024])}, fill=i + 1)
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        s3.put_object(Bucket="models", Key=f"llm/{name}", Body=data)
        names.append(name)
        total += len(data)
    return total, names


def s3_env(endpoint: str) -> list[dict[str, str]]:
    """What KServe's injector gives the init container for an S3 Secret with endpoint annotations."""
    return [{"name": k, "value": v} for k, v in {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "S3_ENDPOINT": endpoint,
        "AWS_ENDPOINT_URL": f"http://{endpoint}", "S3_USE_HTTPS": "0", "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1"}.items()]


def init_resources() -> dict[str, Any]:
    """The init container's resources as KServe's injector sets them (its storageInitializer config)."""
    from tests.kserve.controller import config_map

    cfg = json.loads(config_map()["data"]["storageInitializer"])
    return {"requests": {"cpu": cfg["cpuRequest"], "memory": cfg["memoryRequest"]},
            "limits": {"cpu": cfg["cpuLimit"], "memory": cfg["memoryLimit"]}}


CACHE_CLAIM = "llm-cache"


def pod(name: str, variant: str, init_image: str | None, endpoint: str, sub_path: str) -> dict[str, Any]:
    serve: dict[str, Any] = {
        "name": "kserve-container", "image": static_image("serve").ref,
        "args": ["--model-name=llm", "--model-dir=/mnt/models", "--digest=none"],
        "readinessProbe": {"httpGet": {"path": "/v1/models/llm", "port": 8080}, "periodSeconds": 1},
        "volumeMounts": [{"name": "model", "mountPath": "/mnt/models", "readOnly": True}]}
    spec: dict[str, Any] = {"nodeName": "node-1", "terminationGracePeriodSeconds": 1, "containers": [serve],
                            "enableServiceLinks": False}
    if variant in ("a", "b"):
        spec["initContainers"] = [{"name": "storage-initializer", "image": init_image, "imagePullPolicy": "Never",
                                   "args": ["s3://models/llm", "/mnt/models"], "env": s3_env(endpoint),
                                   "resources": init_resources(),
                                   "volumeMounts": [{"name": "model", "mountPath": "/mnt/models"}]}]
        spec["volumes"] = [{"name": "model", "emptyDir": {}}]
        spec["securityContext"] = {"fsGroup": 1000}
    elif variant == "c":
        spec["volumes"] = [{"name": "model", "persistentVolumeClaim": {"claimName": CACHE_CLAIM, "readOnly": True}}]
        serve["volumeMounts"][0]["subPath"] = sub_path
    else:
        spec["volumes"] = [{"name": "model", "emptyDir": {}}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def _ready(obj: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


@dataclass
class Start:
    ready: float  # seconds from the create request to Ready, seen on a watch of the pod
    init: float  # the init container's run (its start and finish times: whole seconds), 0 without
    load: float  # the serving container reading the model, as it logs it


LOADED = re.compile(r"serve: loaded model \S+ from \S+: \d+ files, \d+ bytes in ([0-9.]+) s")


def _init_seconds(obj: dict[str, Any]) -> float:
    from datetime import datetime

    for state in (obj.get("status") or {}).get("initContainerStatuses") or []:
        done = (state.get("state") or {}).get("terminated") or {}
        if done.get("startedAt") and done.get("finishedAt"):
            took = datetime.fromisoformat(done["finishedAt"]) - datetime.fromisoformat(done["startedAt"])
            return took.total_seconds()
    return 0.0


def ready_after(run: RealNodes, manifest: dict[str, Any], timeout: float = 900) -> Start:
    """The pod created, timed until Ready on a watch of it; then deleted."""
    import urllib.parse
    import urllib.request

    cp = run.cp
    assert cp is not None
    name = manifest["metadata"]["name"]
    started = time.monotonic()
    status, body = cp.raw("/api/v1/namespaces/default/pods", "POST", manifest)
    if status != 201:
        sys.exit(f"creating pod {name}: {status} {body[:500]}")
    rv = json.loads(body)["metadata"]["resourceVersion"]
    query = urllib.parse.urlencode({"watch": "1", "resourceVersion": rv, "fieldSelector": f"metadata.name={name}",
                                    "timeoutSeconds": str(int(timeout))})
    took = None
    with urllib.request.urlopen(f"{cp.server}/api/v1/namespaces/default/pods?{query}", timeout=timeout,
                                context=cp.ssl_context()) as stream:
        for line in stream:
            event = json.loads(line)
            obj = event.get("object") or {}
            if _ready(obj):
                took = time.monotonic() - started
                break
            statuses = (obj.get("status") or {}).get("initContainerStatuses") or []
            failed = [s for s in statuses if ((s.get("state") or {}).get("terminated") or {}).get("exitCode")]
            if failed or (obj.get("status") or {}).get("phase") == "Failed":
                break
    if took is None:
        describe = cp.kubectl("describe", "pod", name, check=False).stdout[-3000:]
        logs = cp.kubectl("logs", name, "--all-containers", "--tail=30", check=False).stdout
        sys.exit(f"pod {name} not Ready:\n{describe}\n{logs}")
    _, body = cp.raw(f"/api/v1/namespaces/default/pods/{name}")
    log = cp.kubectl("logs", name, "-c", "kserve-container", check=False).stdout
    loaded = LOADED.search(log)
    cp.kubectl("delete", "pod", name, "--wait=true", "--timeout=120s")
    return Start(took, _init_seconds(json.loads(body)), float(loaded.group(1)) if loaded else float("nan"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=REPO / ".work" / "bench-podstart",
                        help="the run's control plane, nodes and origin: emptied first, removed at the end")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/podstart.py runs kubelets: run it as root")
    # A fresh folder each run: a control plane's new CA would not accept the last run's node
    # certificates, and the last model must not count.
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    ours = os.environ.get("IMAGE") or project_image()
    base = next(line.split("=", 1)[1].strip() for line in (REPO / "Dockerfile").read_text().splitlines()
                if line.startswith("ARG BASE_IMAGE="))
    theirs = kserve_image(base)
    penv = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    run = RealNodes(args.work / "run", nodes=1, kubelets=1,
                    images=[podman_archive(ours, penv), podman_archive(theirs, penv)]).start()
    server = relay = None
    try:
        server = start_seaweedfs(args.work / "s3", host=run.host_ip)
        host, port = server.endpoint.split("://", 1)[1].rsplit(":", 1)
        relay = CountingRelay(run.host_ip, (host, int(port)))
        size, names = make_model(server.endpoint, parse_size(args.size), args.shards)
        # (c)'s copy: the model where the cache leaves it in the node folder (filled once by ours,
        # every file checked against the origin's digest by the serving container).
        node = run.nodes[0]
        root, sub_path = "/models", "models/llm"
        assert run.cp is not None
        fill = pod("fill", "b", ours, relay.endpoint, "")
        fill["spec"]["volumes"] = [{"name": "model", "hostPath": {"path": f"{root}/{sub_path}",
                                                                   "type": "DirectoryOrCreate"}}]
        fill["spec"]["containers"][0]["args"][-1] = "--digest=sha256"
        # A hostPath the kubelet makes is root's (the agent's prepare-root hands it over; here root fills it).
        fill["spec"]["initContainers"][0]["securityContext"] = {"runAsUser": 0}
        ready_after(run, fill)
        assert sorted(p.name for p in node.host_path(root).joinpath(sub_path).iterdir()) == sorted(names)
        # (c)'s volume: the node group's PV and a claim, as the coordinator makes them.
        for obj in local_volume(CACHE_CLAIM, "default", node.name, root, "10Gi"):
            run.cp.kubectl("create", "-f", "-", input=yaml.safe_dump(obj))
        load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        starts: dict[str, list[Start]] = {v: [] for v in "abcd"}
        origin: dict[str, list[int]] = {v: [] for v in "abcd"}
        order = list("abcd")
        for r in range(args.rounds):
            for variant in order:
                relay.reset()
                image = {"a": theirs, "b": ours}.get(variant)
                start = ready_after(run, pod(f"p{r}{variant}", variant, image, relay.endpoint, sub_path))
                starts[variant].append(start)
                origin[variant].append(relay.bytes_from_origin)
                print(f"round {r + 1} ({variant}): {start.ready:.2f} s (init {start.init:.0f} s, serving container "
                      f"read the model in {start.load:.2f} s), {relay.bytes_from_origin} bytes from the origin",
                      flush=True)
            order = order[1:] + order[:1]
        med = {v: statistics.median(st.ready for st in starts[v]) for v in "abcd"}
        init = {v: statistics.median(st.init for st in starts[v]) for v in "abcd"}
        read = {v: statistics.median(st.load for st in starts[v]) for v in "abcd"}
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        print(f"\nmodel: {len(names)} safetensors shards, {size / 2**30:.2f} GiB; {args.rounds} rounds\n"
              f"load before: {load_before}\nload after:  {load}")
        labels = {"a": f"KServe's initializer ({KSERVE_STORAGE})", "b": "modelcache initializer",
                  "c": "model on the node (cache)", "d": "no model"}
        print("| variant | median to Ready | rounds | init container | serving container reads the model | "
              "origin bytes (per start) |\n|---|---:|---|---:|---:|---:|")
        for v in "abcd":
            print(f"| ({v}) {labels[v]} | {med[v]:.2f} s | {', '.join(f'{st.ready:.2f}' for st in starts[v])} | "
                  f"{init[v]:.0f} s | {read[v]:.2f} s | {statistics.median(origin[v]):,.0f} |")
        print(f"\n(b)/(a) = {med['b'] / med['a']:.2f} (target <= 0.5); (c)/(d) = {med['c'] / med['d']:.2f} "
              f"(target <= 1.2); without the serving container's read of the weights, (c)/(d) = "
              f"{(med['c'] - read['c']) / (med['d'] - read['d']):.2f}")
        print(json.dumps({"median_s": med, "init_s": init, "read_s": read, "origin_bytes": origin, "size": size}))
        return 0
    finally:
        if relay is not None:
            relay.close()
        if server is not None:
            server.stop()
        run.stop()
        # The origin's copy, the node's and the run's files: twice the model and more.
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
