"""A file system that fills up in the middle of a download, made by the test (a small tmpfs).

The space check before a download passes; then another writer takes every free byte while the
model streams in. The pull must fail with the insufficient-space error, leave every other model
intact and verifiable, keep what it had staged, and resume once space is freed. The same for the
agent in standalone mode: its status shows the error, the other models stay Downloaded.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.agent_util import agent_cmd, run_agent, status_of, write_node
from tests.faultproxy import FaultProxy
from tests.fixtures.http import NginxServer
from tests.helpers import REPO, fill_up, mounted_tmpfs, wait_until
from tests.pull_helpers import journaled_bytes, model_files, popen_cli, run_cli

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
BIG = 24 * MiB
D, E = "ModelDownloaded", "ModelDownloadError"


def _fill_while_streaming(proc: subprocess.Popen[str], proxy: FaultProxy, root: Path, uri: str) -> Path:
    """Once a quarter of ``uri`` is journaled, hold the stream, take every free byte, let it go on."""
    wait_until(lambda: journaled_bytes(root, uri) >= BIG // 4 or proc.poll() is not None, timeout=90,
               what="a quarter of the model journaled")
    assert proc.poll() is None, "the download ended before the disk could fill up"
    proxy.pause()
    try:
        filler = fill_up(root / "filler")
    finally:
        proxy.resume()
    return filler


def test_pull_fails_cleanly_when_the_disk_fills_mid_download_and_resumes(
    nginx: NginxServer, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    with mounted_tmpfs(tmp_path / "fs", "size=112m") as root:
        small = nginx.write("a/w.bin", 4 * MiB).read_bytes()
        ua = nginx.url("a/w.bin")
        assert run_cli("pull", ua, "--root", str(root), "--progress", "none").returncode == 0
        big = nginx.write("b/w.bin", BIG).read_bytes()
        ub = fault_proxy.url("b/w.bin")
        fault_proxy.set_rate_limit(6 * MiB)
        # Small chunks: a journal line per 64 KiB, so the journal needs new blocks as it streams.
        proc = popen_cli("pull", ub, "--root", str(root), "--progress", "none", "--json", "--chunk-size", "64K",
                         "--workers", "2")
        filler = _fill_while_streaming(proc, fault_proxy, root, ub)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        assert "Traceback" not in err
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert "no space left on device" in line and "free space or run `modelcache gc`" in line, line
        (result,) = json.loads(out)
        assert result["reason"] == "InsufficientSpace" and not result["ok"]
        assert not (root / "models" / storage_key(ub)).exists()  # nothing half-published

        # The other model is untouched and verifies byte for byte.
        assert model_files(root, ua) == {"w.bin": small}
        verify = run_cli("verify", "--root", str(root))
        assert verify.returncode == 0 and f"{storage_key(ua)}: ok" in verify.stdout, verify.stdout + verify.stderr

        # Space freed: the same pull (same chunk plan) resumes from what it had staged.
        done_before = journaled_bytes(root, ub)
        assert done_before >= BIG // 4
        filler.unlink()
        fault_proxy.set_rate_limit(None)
        fault_proxy.reset_counters()
        again = run_cli("pull", ub, "--root", str(root), "--progress", "none", "--chunk-size", "64K", timeout=120)
        assert again.returncode == 0, again.stderr
        assert model_files(root, ub) == {"w.bin": big}
        assert fault_proxy.total_bytes_sent <= BIG - done_before + 4 * MiB, "the staged bytes were fetched again"
        assert NodeStore.at(root).verify(storage_key(ub)) == [] and NodeStore.at(root).verify(storage_key(ua)) == []


def test_agent_reports_a_disk_that_fills_mid_download_and_keeps_the_other_models(
    nginx: NginxServer, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    with mounted_tmpfs(tmp_path / "fs", "size=112m") as root:
        small = nginx.write("a/w.bin", 4 * MiB).read_bytes()
        ua = nginx.url("a/w.bin")
        spec = write_node(tmp_path / "node.yaml", [{"modelName": "small", "sourceModelUri": ua}])
        assert run_agent(spec, root).returncode == 0
        big = nginx.write("b/w.bin", BIG).read_bytes()
        ub = fault_proxy.url("b/w.bin")
        spec = write_node(tmp_path / "node.yaml", [{"modelName": "small", "sourceModelUri": ua},
                                                    {"modelName": "big", "sourceModelUri": ub}])
        fault_proxy.set_rate_limit(6 * MiB)
        proc = subprocess.Popen(agent_cmd(spec, root, "--chunk-size", "64Ki"), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        filler = _fill_while_streaming(proc, fault_proxy, root, ub)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err[-2000:]
        assert "Traceback" not in err
        st = status_of(spec)
        assert st["modelStatus"] == {"small": D, "big": E}
        detail = st["modelDetails"]["big"]
        assert detail["message"].startswith("InsufficientSpace: ") and "no space left on device" in detail["message"]
        assert model_files(root, ua) == {"w.bin": small}
        assert NodeStore.at(root).verify(storage_key(ua)) == []

        filler.unlink()
        fault_proxy.set_rate_limit(None)
        fault_proxy.reset_counters()
        done_before = journaled_bytes(root, ub)
        again = run_agent(spec, root, "--chunk-size", "64Ki")
        assert again.returncode == 0, again.stderr[-2000:]
        assert status_of(spec)["modelStatus"] == {"small": D, "big": D}
        assert model_files(root, ub) == {"w.bin": big}
        assert fault_proxy.total_bytes_sent <= BIG - done_before + 4 * MiB, "the staged bytes were fetched again"
