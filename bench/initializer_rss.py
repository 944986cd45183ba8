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


KSERVE_PY = REPO / ".work" / "kserve-venv" / "bin" / "python"  # made by bench/pull_http.py
_KSERVE_SCRIPT = "import sys\nfrom kserve_storage import Storage\nStorage.download(sys.argv[1], sys.argv[2])\n"


def _measure(cmd: list[str], env: dict[str, str]) -> tuple[int, float, float]:
    """(exit code, seconds, peak RSS MiB) of one child, from wait4's rusage."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.monotonic() - start, usage.ru_maxrss / 1024  # Linux: KiB


def run(size: int, work: Path, env_extra: dict[str, str], kserve: bool = False) -> dict[str, object]:
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
        url = server.url("model.bin")
        code, seconds, peak_mib = _measure([sys.executable, "-m", "initializer", url, str(dest)], env)
        if code != 0:
            raise SystemExit(f"initializer failed with exit code {code}")
        got = (dest / "model.bin").stat().st_size
        if got != size:
            raise SystemExit(f"wrong size: {got} != {size}")
        shutil.rmtree(dest)
        extra: dict[str, object] = {}
        if kserve and KSERVE_PY.exists():
            # The same download through KServe's own initializer code, for comparison.
            kdest = work / "out" / "kserve"
            kdest.mkdir()
            kcode, kseconds, kpeak = _measure([str(KSERVE_PY), "-c", _KSERVE_SCRIPT, url, str(kdest)], env)
            extra = {"kserve_exit": kcode, "kserve_seconds": round(kseconds, 2), "kserve_peak_rss_mib": round(kpeak, 1)}
            shutil.rmtree(kdest)
        return {
            "bench": "initializer_rss",
            "size_bytes": size,
            "seconds": round(seconds, 2),
            "mib_per_s": round(size / (1 << 20) / seconds, 1),
            "peak_rss_mib": round(peak_mib, 1),
            "target_mib": TARGET_MIB,
            "ok": peak_mib <= TARGET_MIB,
            "env": env_extra,
            **extra,
        }
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for the initializer")
    ap.add_argument("--kserve", action="store_true", help="also measure KServe's initializer (.work/kserve-venv)")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mc-rss-"))
    extra = dict(item.split("=", 1) for item in args.env)
    try:
        result = run(int(args.size_gib * (1 << 30)), work, extra, kserve=args.kserve)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
