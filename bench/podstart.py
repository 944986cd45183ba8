#!/usr/bin/env python3
"""Benchmark: time to a Ready serving pod on a real node (issue 24, item 7).

One real node (tests/cluster/realnodes.py: a kubelet and a containerd on this machine), a model
of safetensors shards (default 2 GiB) in SeaweedFS on the node network's host address, behind a
relay that counts the bytes the origin sends. For each variant, side by side and in a rotating
order, a predictor pod is created as KServe's Deployment makes it and timed until it is Ready:

  (a) KServe's storage initializer as the init container: an image built here from the
      `kserve-storage` package on PyPI, as KServe's own Dockerfile builds it from its package,
      with an entrypoint of ours that calls `Storage.download(src, dest)` as KServe's does;
  (b) ours as the init container (the project image, `make image`);
  (c) the model already on the node (what the cache gives: the node's folder mounted read-only);
  (d) the same serving pod with no model at all.

The serving container (tests/cluster/runtime/cmd/serve, `--digest=none`) reads every byte of the
model before it says Ready, as a model server loads its weights. Prints the median of the rounds,
the ratios (targets: b <= 0.5 x a; c <= 1.2 x d), origin bytes per variant and the load.

    sudo .venv/bin/python bench/podstart.py                      # 2 GiB, 3 rounds
    sudo .venv/bin/python bench/podstart.py --size 256MiB --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modelcache.sizes import parse_size  # noqa: E402
from tests.cluster.images import podman_archive, project_image, static_image  # noqa: E402
from tests.cluster.realnodes import RealNodes  # noqa: E402
from tests.counting_relay import CountingRelay  # noqa: E402
from tests.fixtures.seaweedfs import ACCESS_KEY, SECRET_KEY, start_seaweedfs  # noqa: E402
from tests.node_util import safetensors  # noqa: E402

KSERVE_STORAGE = "kserve-storage==0.21.0"
KSERVE_IMAGE = "localhost/modelcache-bench/kserve-storage-initializer:0.21.0"
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


def pod(name: str, variant: str, init_image: str | None, endpoint: str, model_dir: str) -> dict[str, Any]:
    serve = {"name": "kserve-container", "image": static_image("serve").ref,
             "args": ["--model-name=llm", "--model-dir=/mnt/models", "--digest=none"],
             "readinessProbe": {"httpGet": {"path": "/v1/models/llm", "port": 8080}, "periodSeconds": 1},
             "volumeMounts": [{"name": "model", "mountPath": "/mnt/models", "readOnly": True}]}
    spec: dict[str, Any] = {"nodeName": "node-1", "terminationGracePeriodSeconds": 1, "containers": [serve]}
    if variant in ("a", "b"):
        spec["initContainers"] = [{"name": "storage-initializer", "image": init_image, "imagePullPolicy": "Never",
                                   "args": ["s3://models/llm", "/mnt/models"], "env": s3_env(endpoint),
                                   "volumeMounts": [{"name": "model", "mountPath": "/mnt/models"}]}]
        spec["volumes"] = [{"name": "model", "emptyDir": {}}]
        spec["securityContext"] = {"fsGroup": 1000}
    elif variant == "c":
        spec["volumes"] = [{"name": "model", "hostPath": {"path": model_dir, "type": "Directory"}}]
    else:
        spec["volumes"] = [{"name": "model", "emptyDir": {}}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def ready_after(run: RealNodes, manifest: dict[str, Any], timeout: float = 900) -> float:
    assert run.cp is not None
    name = manifest["metadata"]["name"]
    started = time.monotonic()
    run.cp.kubectl("create", "-f", "-", input=yaml.safe_dump(manifest))
    while True:
        status = run.cp.kubectl("get", "pod", name, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
                                check=False).stdout
        if status == "True":
            took = time.monotonic() - started
            break
        if time.monotonic() - started > timeout:
            sys.exit(f"pod {name} not Ready after {timeout:.0f} s:\n"
                     f"{run.cp.kubectl('describe', 'pod', name, check=False).stdout[-3000:]}")
        time.sleep(0.05)
    run.cp.kubectl("delete", "pod", name, "--wait=true", "--timeout=120s")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=REPO / ".work" / "bench-podstart")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/podstart.py runs kubelets: run it as root")
    args.work.mkdir(parents=True, exist_ok=True)
    ours = os.environ.get("IMAGE") or project_image()
    base = next(line.split("=", 1)[1].strip() for line in (REPO / "Dockerfile").read_text().splitlines()
                if line.startswith("ARG BASE_IMAGE="))
    theirs = kserve_image(base)
    run = RealNodes(args.work / "run", nodes=1, kubelets=1,
                    images=[podman_archive(ours), podman_archive(theirs)]).start()
    server = relay = None
    try:
        server = start_seaweedfs(args.work / "s3", host=run.host_ip)
        host, port = server.endpoint.split("://", 1)[1].rsplit(":", 1)
        relay = CountingRelay(run.host_ip, (host, int(port)))
        size, names = make_model(server.endpoint, parse_size(args.size), args.shards)
        # (c)'s copy: the model as the cache leaves it in the node's folder (filled once by ours).
        node = run.nodes[0]
        on_node = "/models/models/llm"
        assert run.cp is not None
        fill = pod("fill", "b", ours, relay.endpoint, "")
        fill["spec"]["volumes"] = [{"name": "model", "hostPath": {"path": on_node, "type": "DirectoryOrCreate"}}]
        fill["spec"]["containers"][0]["args"][-1] = "--digest=sha256"
        ready_after(run, fill)
        assert sorted(p.name for p in node.host_path(on_node).iterdir()) == sorted(names)
        times: dict[str, list[float]] = {v: [] for v in "abcd"}
        origin: dict[str, list[int]] = {v: [] for v in "abcd"}
        order = list("abcd")
        for r in range(args.rounds):
            for variant in order:
                relay.reset()
                image = {"a": theirs, "b": ours}.get(variant)
                took = ready_after(run, pod(f"p{r}{variant}", variant, image, relay.endpoint, on_node))
                times[variant].append(took)
                origin[variant].append(relay.bytes_from_origin)
                print(f"round {r + 1} ({variant}): {took:.2f} s, {relay.bytes_from_origin} bytes from the origin",
                      flush=True)
            order = order[1:] + order[:1]
        med = {v: statistics.median(t) for v, t in times.items()}
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        print(f"\nmodel: {len(names)} safetensors shards, {size / 2**30:.2f} GiB; {args.rounds} rounds; {load}")
        labels = {"a": "KServe's initializer (kserve-storage 0.21.0)", "b": "modelcache initializer",
                  "c": "model on the node (cache)", "d": "no model"}
        print("| variant | median to Ready | rounds | origin bytes (per start) |\n|---|---|---|---|")
        for v in "abcd":
            print(f"| ({v}) {labels[v]} | {med[v]:.2f} s | {', '.join(f'{t:.2f}' for t in times[v])} | "
                  f"{statistics.median(origin[v]):,.0f} |")
        print(f"\n(b)/(a) = {med['b'] / med['a']:.2f} (target <= 0.5); (c)/(d) = {med['c'] / med['d']:.2f} "
              "(target <= 1.2)")
        print(json.dumps({"median_s": med, "origin_bytes": origin, "size": size}))
        return 0
    finally:
        if relay is not None:
            relay.close()
        if server is not None:
            server.stop()
        run.stop()


if __name__ == "__main__":
    sys.exit(main())
