"""KServe's controller manager and local-model controller, built from the module next to this file.

tests/kserve/go.mod requires github.com/kserve/kserve at one release and repeats its replace lines;
`go build` of its cmd/manager and cmd/localmodel gives `.work/kserve/bin/{manager,localmodel}`.
The build, stamp and skip are tests/cluster/build.py's (`GoCommands`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

from tests.cluster.build import REPO, GoCommands

MODULE = Path(__file__).resolve().parent
KSERVE = GoCommands(
    title="KServe's controller manager",
    module=MODULE,
    bin_dir=REPO / ".work" / "kserve" / "bin",
    commands={"manager": "github.com/kserve/kserve/cmd/manager",
              "localmodel": "github.com/kserve/kserve/cmd/localmodel"},
    pin_files=("go.mod", "go.sum", "tools.go"),
    cold_build="about 10 minutes",
)
BIN = KSERVE.bin_dir


def kserve_version() -> str:
    return KSERVE.pinned_version("github.com/kserve/kserve")


@functools.cache
def kserve_source() -> Path:
    """KServe's module as `go build` used it (its CRDs, webhook configurations, RBAC and config map),
    read at test time from the Go module cache: nothing of it is copied into this repository."""
    proc = subprocess.run(["go", "list", "-m", "-json", "github.com/kserve/kserve"], cwd=MODULE, capture_output=True,
                          text=True, env={**os.environ, "GOTOOLCHAIN": os.environ.get("GOTOOLCHAIN", "local")})
    folder = json.loads(proc.stdout).get("Dir") if proc.returncode == 0 else None
    if not folder:
        raise RuntimeError(f"KServe {kserve_version()} is not in the Go module cache: run tests/setup.d/55-kserve.sh "
                           f"({proc.stderr.strip()})")
    return Path(folder)
