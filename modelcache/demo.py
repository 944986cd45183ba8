"""`make demo`: the main job on an embedded default, no cloud account and no cluster.

It makes a sample model (safetensors-shaped shards plus small json files), serves it from a
local HTTP server it starts and stops, pulls it into a node store with progress, pulls it
again (a cache hit), verifies the store and lists it. Every step runs the real `modelcache`
command so what you see is what a user gets.
"""

from __future__ import annotations

import json
import os
import shlex
import struct
import subprocess
import sys
import time
from pathlib import Path

from modelcache.devserver import serve

WORK = Path(os.environ.get("MODELCACHE_DEMO_DIR", ".work/demo"))
SHARDS = int(os.environ.get("MODELCACHE_DEMO_SHARDS", "3"))
SHARD_MB = int(os.environ.get("MODELCACHE_DEMO_SHARD_MB", "192"))


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


def agent_step(uris: list[str]) -> None:
    """The node agent's job without a cluster: a LocalModelNode file in, a filled root and its status out."""
    import shutil

    import yaml

    node_root, spec = WORK / "node", WORK / "localmodelnode.yaml"
    shutil.rmtree(node_root, ignore_errors=True)
    names = [Path(u).name.split(".")[0].lower().replace("_", "-") for u in uris]
    entries = [{"modelName": f"sample-{n}", "sourceModelUri": u} for n, u in zip(names, uris, strict=True)]
    spec.write_text(yaml.safe_dump({"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNode",
                                    "metadata": {"name": "demo-node"}, "spec": {"localModels": entries}}))
    args = ["--standalone", str(spec), "--root", str(node_root), "--port", "-1"]
    print(f"\n\033[1m== agent: fill a node root from a LocalModelNode, report status\033[0m\n"
          f"$ modelcache-agent {' '.join(shlex.quote(a) for a in args)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "agent", *args])
    status = yaml.safe_load(spec.with_name(spec.name + ".status.yaml").read_text())["status"]
    print(yaml.safe_dump({"modelStatus": status["modelStatus"], "modelCounts": status["modelCounts"]},
                         sort_keys=False), end="")
    print(f"({time.monotonic() - t0:.2f}s, exit {proc.returncode}; full status in {spec}.status.yaml)", flush=True)
    if proc.returncode != 0:
        sys.exit(proc.returncode)


def main() -> None:
    src = WORK / "model"
    root = WORK / "store"
    print(f"making a sample model in {src} ({SHARDS} x {SHARD_MB} MiB safetensors shards + json) ...", flush=True)
    files = make_model(src)
    server = serve(src)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    print(f"serving it at {base}/ (Range, ETag and Repr-Digest sha-256)")
    uris = [f"{base}/{name}" for name in files]
    try:
        if root.exists():
            subprocess.run([sys.executable, "-m", "modelcache", "rm", "--root", str(root), *uris],
                           capture_output=True)
        step("pull: parallel ranged reads, sha-256 verified, published atomically",
             ["pull", *uris, "--root", str(root)])
        step("pull again: a cache hit, no request sent", ["pull", *uris, "--root", str(root)])
        step("verify: re-hash every file against its manifest", ["verify", "--root", str(root)])
        step("ls: the node store", ["ls", "--root", str(root)])
        agent_step(uris)
    finally:
        server.shutdown()
    print(f"\nthe model files are under {root}/models/<storageKey>/, exactly where KServe's pods look for them")


if __name__ == "__main__":
    main()
