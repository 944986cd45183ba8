"""`make demo`'s part without a cluster: the main job on an embedded default, no cloud account.

It makes a sample model (safetensors-shaped shards plus small json files), serves it from a
local HTTP server it starts and stops, pulls it into a node store with progress, pulls it
again (a cache hit), verifies the store and lists it, then fills a node root with the agent in
standalone mode. Every step runs the real command it prints (with every flag it uses), so what
you see is what a user gets.

An HTTP URI names one file (HTTP has no listing): one URI, one stored model. So the model is
served as one archive, which modelcache (as KServe) unpacks into one model folder; a folder of
files comes whole from a listing source instead (a local path, S3, GCS, Azure, HF, OCI, HDFS).

Not in the wheel: it runs from a checkout (``python -m examples.demo``, or ``make demo``). Where:
``$MODELCACHE_DEMO_DIR``, else ``.work/demo`` in the project's checkout, else (run from elsewhere)
a folder under the system's temporary directory, never the current directory.
"""

from __future__ import annotations

import json
import os
import shlex
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from examples.devserver import serve


def _work() -> Path:
    if os.environ.get("MODELCACHE_DEMO_DIR"):
        return Path(os.environ["MODELCACHE_DEMO_DIR"])
    if Path("Makefile").is_file() and Path("examples/demo.py").is_file():  # the project's checkout
        return Path(".work/demo")
    return Path(tempfile.gettempdir()) / "modelcache-demo"


WORK = _work()
SHARDS = int(os.environ.get("MODELCACHE_DEMO_SHARDS", "3"))
SHARD_MB = int(os.environ.get("MODELCACHE_DEMO_SHARD_MB", "64"))


def write_shard(path: Path, index: int, size: int) -> None:
    """A file laid out like safetensors: u64 header length, JSON header, then tensor bytes."""
    n = 4096
    tensors: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    per = (size - 4096) // n // 2 * 2
    for t in range(n):
        tensors[f"model.layers.{index}.w{t}"] = {
            "dtype": "BF16", "shape": [per // 2], "data_offsets": [offset, offset + per]}
        offset += per
    header = json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        remaining = offset
        block = 8 << 20
        while remaining > 0:
            f.write(os.urandom(min(block, remaining)))
            remaining -= block


def make_model(folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors" for i in range(SHARDS)]
    for i, name in enumerate(names):
        if not (folder / name).exists():
            tmp = folder / (name + ".tmp")
            write_shard(tmp, i, SHARD_MB << 20)
            tmp.rename(folder / name)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}))
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 256}))
    index = {"metadata": {"total_size": sum((folder / n).stat().st_size for n in names)},
             "weight_map": {f"layer.{i}": n for i, n in enumerate(names)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return [*names, "config.json", "generation_config.json", "model.safetensors.index.json"]


def step(title: str, args: list[str]) -> None:
    print(f"\n\033[1m== {title}\033[0m\n$ modelcache {' '.join(shlex.quote(a) for a in args)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "modelcache", *args])
    print(f"({time.monotonic() - t0:.2f}s, exit {proc.returncode})", flush=True)
    if proc.returncode != 0:
        sys.exit(proc.returncode)


def make_archive(folder: Path, files: list[str], archive: Path) -> None:
    """The model as one uncompressed tar (its shards do not compress): what an HTTP server serves
    when a model of several files must be one URI."""
    if archive.exists():
        return
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w") as tar:
        for name in files:
            tar.add(folder / name, arcname=name)
    tmp.rename(archive)


def agent_step(uri: str) -> Path:
    """The node agent's job without a cluster: a LocalModelNode file in, a filled root and its status out."""
    import shutil

    import yaml

    node_root, spec = WORK / "node", WORK / "localmodelnode.yaml"
    shutil.rmtree(node_root, ignore_errors=True)
    spec.write_text(yaml.safe_dump({"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNode",
                                    "metadata": {"name": "demo-node"},
                                    "spec": {"localModels": [{"modelName": "sample-llm", "sourceModelUri": uri}]}}))
    args = ["--standalone", str(spec), "--root", str(node_root), "--port", "-1"]
    print(f"\n\033[1m== agent: fill a node root of its own from a LocalModelNode, report status\033[0m\n"
          f"$ modelcache-agent {' '.join(shlex.quote(a) for a in args)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "agent", *args])
    status = yaml.safe_load(spec.with_name(spec.name + ".status.yaml").read_text())["status"]
    print(yaml.safe_dump({"modelStatus": status["modelStatus"], "modelCounts": status["modelCounts"]},
                         sort_keys=False), end="")
    print(f"({time.monotonic() - t0:.2f}s, exit {proc.returncode}; full status in {spec}.status.yaml)", flush=True)
    if proc.returncode != 0:
        sys.exit(proc.returncode)
    return node_root


def main() -> None:
    from modelcache.sources.uri import storage_key

    src = WORK / "model"
    root = WORK / "store"
    print(f"making a sample model in {src} ({SHARDS} x {SHARD_MB} MiB safetensors shards + json) ...", flush=True)
    files = make_model(src)
    archive = WORK / "served" / "sample-llm.tar"
    archive.parent.mkdir(parents=True, exist_ok=True)
    make_archive(src, files, archive)
    server = serve(archive.parent)
    uri = f"http://127.0.0.1:{server.server_address[1]}/{archive.name}"
    print(f"serving it at {uri} (Range, ETag and Repr-Digest sha-256)\n"
          "an HTTP URI names one file (HTTP has no listing), so the model is served as one archive: modelcache, "
          "as KServe, unpacks a model that is one .tar/.tgz/.zip into one folder (a folder of files comes whole from "
          "a local path, S3, GCS, Azure, HF, OCI or HDFS)", flush=True)
    try:
        if root.exists():
            subprocess.run([sys.executable, "-m", "modelcache", "rm", "--root", str(root), uri], capture_output=True)
        step("pull: parallel ranged reads, sha-256 verified, unpacked, published atomically",
             ["pull", uri, "--root", str(root)])
        step("pull again: a cache hit, no request sent", ["pull", uri, "--root", str(root)])
        step("verify: re-hash every file against its manifest", ["verify", "--root", str(root)])
        step("ls: the node store", ["ls", "--root", str(root)])
        node_root = agent_step(uri)
    finally:
        server.shutdown()
    key = storage_key(uri)
    shown = sorted(p.name for p in (root / "models" / key).iterdir())
    print(f"\none model, {len(shown)} files ({', '.join(shown)}) in {root}/models/{key}/ and "
          f"{node_root}/models/{key}/: one folder per model, named by its storageKey, exactly where KServe's pods "
          f"look for it\n(everything is under {WORK}: `rm -rf {WORK}` removes it)")


if __name__ == "__main__":
    main()
