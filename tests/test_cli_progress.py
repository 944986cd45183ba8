"""What a user sees while a long pull runs: log lines off a TTY, bars on one; pvc:// sources."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from modelcache.sources.uri import storage_key

LINE = re.compile(r"^\s*\d+\.\d% [\d.]+ \w+/[\d.]+ \w+ files \d+/\d+ [\d.]+ \w+/s eta \S+$")


def test_plain_progress_lines_in_logs(nginx, tmp_path):
    nginx.write("slow/w.bin", 3 << 20)
    # nginx lets each response send one second's worth at once, then 1 MiB/s: one request of
    # 3 MiB takes ~2 s.
    nginx.set_limit_rate("slow", 1 << 20)
    proc = subprocess.run(
        [sys.executable, "-m", "modelcache", "pull", nginx.url("slow/w.bin"), "--root", str(tmp_path / "root"),
         "--progress", "plain", "--progress-interval", "0.3", "--chunk-size", "4M", "--workers", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    progress = [ln for ln in lines if LINE.match(ln)]
    assert len(progress) >= 3, lines  # a line every 0.3 s over a ~2 s pull
    pcts = [float(ln.split("%")[0]) for ln in progress]
    assert pcts == sorted(pcts) and pcts[-1] > 0
    assert "eta" in progress[0] and "3.0 MiB" in progress[-1]
    assert lines[-1].startswith(nginx.url("slow/w.bin")) and "1 file, 3.0 MiB" in lines[-1]


def test_bars_on_a_terminal(nginx, tmp_path):
    nginx.write("slow/t.bin", 2 << 20)
    nginx.set_limit_rate("slow", 1 << 20)
    pid, fd = pty.fork()
    if pid == 0:  # child: stderr is the terminal, as for a user at a shell
        os.execv(sys.executable, [sys.executable, "-m", "modelcache", "pull", nginx.url("slow/t.bin"),
                                  "--root", str(tmp_path / "root"), "--chunk-size", "4M", "--workers", "1"])
    out = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out[-2000:]
    text = out.decode(errors="replace")
    assert "total" in text and "━" in text  # rich's bar
    assert "1 file, 2.0 MiB" in text  # and the summary line after it


def test_pvc_uri_resolves_under_the_mount_root(tmp_path):
    mount = tmp_path / "pvc"
    model = mount / "claim-a" / "models" / "m1"
    (model / "sub").mkdir(parents=True)
    (model / "w.bin").write_bytes(os.urandom(300_000))
    (model / "sub" / "c.json").write_text("{}")
    uri = "pvc://claim-a/models/m1"
    env = {**os.environ, "MODELCACHE_PVC_ROOT": str(mount)}
    proc = subprocess.run([sys.executable, "-m", "modelcache", "pull", uri, "--root", str(tmp_path / "root")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    dest = tmp_path / "root" / "models" / storage_key(uri)
    assert (dest / "w.bin").read_bytes() == (model / "w.bin").read_bytes()
    assert (dest / "sub" / "c.json").read_text() == "{}"
    missing = subprocess.run([sys.executable, "-m", "modelcache", "pull", "pvc://claim-b/m", "--root",
                              str(tmp_path / "root")], capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"error: pvc://claim-b/m: no such file or directory '{mount}/claim-b/m' (PVCs are mounted under {mount})"
    ]


def test_cli_usage_errors_exit_2_with_a_clear_line(tmp_path: Path):
    proc = subprocess.run([sys.executable, "-m", "modelcache", "pull", "ftp://x/y", "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: invalid storage URI 'ftp://x/y': unknown scheme 'ftp://'")
    bad = subprocess.run([sys.executable, "-m", "modelcache", "pull", "/x", "--chunk-size", "lots"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not a size" in bad.stderr
