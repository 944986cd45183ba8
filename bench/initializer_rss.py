"""Peak RSS of storage-initializer pulling one large file from nginx (target: <= 256 MiB for 4 GiB).

KServe's initializer is OOM-killed on files over ~8 GB (kserve#5326). This runs our
entrypoint exactly as the init container does (a subprocess, one SRC DEST pair) against a
real nginx serving a sparse file, and reads the child's peak RSS from ``wait4``.

    .venv/bin/python bench/initializer_rss.py [--size-gib 4] [--keep]

Prints one JSON line: size, seconds, throughput and peak RSS in MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.fixtures.http import LISTENERS, NginxServer, _nginx_binary, make_tls  # noqa: E402
from tests.helpers import free_port  # noqa: E402

TARGET_MIB = 256


def run(size: int, work: Path, env_extra: dict[str, str]) -> dict[str, object]:
    binary = _nginx_binary()
    if binary is None:
        raise SystemExit("nginx is not installed (make test-deps)")
    for sub in ("nginx", "www", "out"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o755)
    model = work / "www" / "model.bin"
    with open(model, "wb") as fh:
        fh.truncate(size)  # sparse: nginx serves zeros, the initializer still writes every byte
    os.chmod(model, 0o644)
    server = NginxServer(
        binary=binary,
        workdir=work / "nginx",
        docroot=work / "www",
        tls=make_tls(work / "tls"),
        ports={name: free_port() for name in LISTENERS},
    )
    server.start()
    try:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
        env.update({"PYTHONPATH": str(REPO), "MODELCACHE_PROGRESS_INTERVAL": "5", **env_extra})
        dest = work / "out" / "model"
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "initializer", server.url("model.bin"), str(dest)],
            env=env,
            cwd=REPO,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            raise SystemExit(f"initializer failed with exit code {proc.returncode}")
        got = (dest / "model.bin").stat().st_size
        if got != size:
            raise SystemExit(f"wrong size: {got} != {size}")
        peak_mib = usage.ru_maxrss / 1024  # Linux: KiB
        return {
            "bench": "initializer_rss",
            "size_bytes": size,
            "seconds": round(seconds, 2),
            "mib_per_s": round(size / (1 << 20) / seconds, 1),
            "peak_rss_mib": round(peak_mib, 1),
            "target_mib": TARGET_MIB,
            "ok": peak_mib <= TARGET_MIB,
            "env": env_extra,
        }
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for the initializer")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mc-rss-"))
    extra = dict(item.split("=", 1) for item in args.env)
    try:
        result = run(int(args.size_gib * (1 << 30)), work, extra)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
