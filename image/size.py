"""`python3 image/size.py IMAGE BASE [--top N] [--json]`: the image's size over its base and what
takes it (`make image-size` runs it on the image `make image` built).

Reads the layers `podman save` writes (uncompressed, OCI layout): the image's layers that the base
does not have are ours. Contributors are grouped by the top-level package under site-packages
(their bytecode included), everything else by its first two path components. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

SITE = re.compile(r"^opt/venv/lib/python3\.\d+/site-packages/([^/]+)")
DIST_INFO = re.compile(r"^(.+?)-[^-]+\.(dist|egg)-info$")


def layer_ids(tool: str, ref: str) -> list[str]:
    out = subprocess.run([tool, "image", "inspect", "--format", "{{json .RootFS.Layers}}", ref],
                         capture_output=True, text=True, check=True).stdout
    return [d.split(":", 1)[1] for d in json.loads(out)]


def own_layers(tool: str, ref: str, base: str, workdir: Path) -> list[Path]:
    """The uncompressed tar of each layer ``ref`` adds on top of ``base``, in order."""
    base_ids = set(layer_ids(tool, base))
    ours = [d for d in layer_ids(tool, ref) if d not in base_ids]
    out = workdir / "oci"
    subprocess.run([tool, "save", "-q", "--format", "oci-dir", "--uncompressed", "-o", str(out), ref],
                   capture_output=True, check=True)
    return [out / "blobs" / "sha256" / d for d in ours]


def members(layer: Path) -> Iterator[tarfile.TarInfo]:
    with tarfile.open(layer) as tf:
        yield from tf


def group(name: str) -> str:
    m = SITE.match(name)
    if m:
        top = m.group(1)
        d = DIST_INFO.match(top)
        return f"site-packages/{d.group(1) if d else top.removesuffix('.py')}"
    return "/".join(name.split("/")[:2]) or name


def measure(layers: list[Path]) -> tuple[int, int, Counter[str]]:
    """(bytes over the base, of which bytecode, bytes per contributor)."""
    total = pyc = 0
    per: Counter[str] = Counter()
    for layer in layers:
        for m in members(layer):
            if not m.isfile():
                continue
            total += m.size
            per[group(m.name)] += m.size
            if m.name.endswith(".pyc"):
                pyc += m.size
    return total, pyc, per


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("image")
    ap.add_argument("base")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tool", default=os.environ.get("CONTAINER_TOOL", "podman"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        total, pyc, per = measure(own_layers(args.tool, args.image, args.base, Path(tmp)))
    top = per.most_common(args.top)
    if args.json:
        print(json.dumps({"over_base": total, "bytecode": pyc, "top": top}))
        return 0
    mb = 1e6
    print(f"{args.image}: {total / mb:.0f} MB over {args.base} (bytecode {pyc / mb:.0f} MB of it)")
    for name, size in top:
        print(f"  {size / mb:6.1f} MB  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
