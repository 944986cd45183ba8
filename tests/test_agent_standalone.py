"""Standalone agent (no cluster): a LocalModelNode file in, the root filled, FILE.status.yaml out;
restart from manifests without re-hashing; periodic checks find damage and repair it."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from modelcache.sources.uri import storage_key
from tests.agent_util import agent_cmd, model_files, run_agent, status_of, write_node
from tests.helpers import REPO, mounted_tmpfs, wait_until

pytestmark = pytest.mark.timeout(120)

D, E = "ModelDownloaded", "ModelDownloadError"


def test_standalone_fills_the_root_and_writes_status_beside_the_file(nginx, tmp_path):
    nginx.write("s/model.bin", 2 << 20)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(os.urandom(300_000))
    http_uri, local_uri = nginx.url("s/model.bin"), f"file://{src}"
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "web", "sourceModelUri": http_uri},
                                                {"modelName": "loc", "sourceModelUri": local_uri,
                                                 "namespace": "team"}])
    before = spec.read_text()
    root = tmp_path / "root"
    proc = run_agent(spec, root)
    assert proc.returncode == 0, proc.stderr
    assert spec.read_text() == before  # the input is never rewritten
    st = status_of(spec)
    assert st["modelStatus"] == {"web": D, "team/loc": D}
    assert st["modelDetails"]["web"]["bytesDone"] == 2 << 20
    assert model_files(root, storage_key(http_uri)) == {"model.bin": 2 << 20}
    assert model_files(root, storage_key(local_uri)) == {"config.json": 2, "sub/w.bin": 300_000}
    assert "download finished" in proc.stderr


def test_error_exit_code_and_orphans_deleted(nginx, tmp_path):
    nginx.write("o/model.bin", 1 << 20)
    uri = nginx.url("o/model.bin")
    root = tmp_path / "root"
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": uri}])
    assert run_agent(spec, root).returncode == 0
    # The entry changes to a missing file: the old model leaves the spec (deleted), the new one fails.
    write_node(spec, [{"modelName": "m", "sourceModelUri": nginx.url("o/missing.bin")}])
    proc = run_agent(spec, root)
    assert proc.returncode == 1
    st = status_of(spec)
    assert st["modelStatus"] == {"m": E}
    assert "404" in st["modelDetails"]["m"]["message"] or "not found" in st["modelDetails"]["m"]["message"].lower()
    assert not (root / "models" / storage_key(uri)).exists()


def test_restart_trusts_manifests_then_full_verify_repairs(nginx, tmp_path):
    data = nginx.write("r/model.bin", 2 << 20).read_bytes()
    uri = nginx.url("r/model.bin")
    root = tmp_path / "root"
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": uri}])
    assert run_agent(spec, root).returncode == 0
    target = root / "models" / storage_key(uri) / "model.bin"
    # Flip one byte, same size: a restart must not re-hash (seconds for a big root), so it does not notice.
    with open(target, "r+b") as f:
        f.seek(12345)
        f.write(bytes([data[12345] ^ 0xFF]))
    nginx.clear_access_log()
    proc = run_agent(spec, root, "--verify-interval", "0")
    assert proc.returncode == 0, proc.stderr
    assert status_of(spec)["modelStatus"] == {"m": D}  # a hash would have found the flipped byte
    assert "model present" in proc.stderr and "download started" not in proc.stderr
    assert nginx.access_log() == []
    # The slower full verify finds it, reports it and repairs it.
    agent = subprocess.Popen(agent_cmd(spec, root, "--watch", "--verify-interval", "1"), cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen: list[str] = []

        def repaired() -> bool:
            d = status_of(spec)["modelDetails"]["m"]
            if "damaged" in (d.get("message") or ""):  # "damaged: ...", "repairing (...)", "repaired ...: ..."
                seen.append(d["message"])
            return bool(seen) and d["state"] == D and target.read_bytes() == data

        wait_until(repaired, timeout=40, what="damage reported and repaired")
        assert "model.bin" in seen[0] and "xxh3" in seen[0]
        assert status_of(spec)["modelDetails"]["m"]["message"].startswith("repaired ")
    finally:
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=20)
    assert "model damaged: repairing" in err


def test_size_check_finds_a_truncated_file_and_watch_picks_up_spec_changes(nginx, tmp_path):
    data = nginx.write("t/model.bin", 1 << 20).read_bytes()
    nginx.write("t2/model.bin", 1 << 20)
    uri, uri2 = nginx.url("t/model.bin"), nginx.url("t2/model.bin")
    root = tmp_path / "root"
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": uri}])
    agent = subprocess.Popen(agent_cmd(spec, root, "--watch", "--size-check-interval", "0.5"), cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        target = root / "models" / storage_key(uri) / "model.bin"
        wait_until(lambda: status_of(spec)["modelStatus"] == {"m": D}, timeout=30, what="downloaded")
        folder_ino = target.parent.stat().st_ino
        os.truncate(target, 1000)
        wait_until(lambda: target.stat().st_size == 1 << 20 and status_of(spec)["modelStatus"] == {"m": D}
                   and status_of(spec)["modelDetails"]["m"]["attempts"] == 2, timeout=30, what="repaired")
        assert target.read_bytes() == data
        assert target.parent.stat().st_ino == folder_ino  # repaired inside the folder pods mount
        write_node(spec, [{"modelName": "m2", "sourceModelUri": uri2}])
        wait_until(lambda: status_of(spec)["modelStatus"] == {"m2": D} and not target.parent.exists(),
                   timeout=30, what="spec change applied")
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(20)


def test_a_file_replaced_by_a_link_out_of_the_root_is_repaired_by_the_size_check(nginx, tmp_path):
    """The security review's 14-symlink-in-model.sh (its premise, a tenant writing the root through
    the serving claim, is refused: tests/test_security_tenants.py): a model's file replaced by a
    link to a file outside the root. The size check finds it, and the repair puts the model's
    bytes back as a regular file in the same folder, replacing the link and never writing where it
    points."""
    data = nginx.write("l/model.bin", 1 << 20).read_bytes()
    uri = nginx.url("l/model.bin")
    root = tmp_path / "root"
    outside = tmp_path / "outside-secret.txt"
    outside.write_text("target secret-on-node\n")
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": uri}])
    agent = subprocess.Popen(agent_cmd(spec, root, "--watch", "--size-check-interval", "0.5"), cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        target = root / "models" / storage_key(uri) / "model.bin"
        wait_until(lambda: status_of(spec)["modelStatus"] == {"m": D}, timeout=30, what="downloaded")
        folder_ino = target.parent.stat().st_ino
        target.rename(target.with_name("model.bin.orig"))
        target.symlink_to(outside)
        seen: list[str] = []

        def repaired() -> bool:
            d = status_of(spec)["modelDetails"]["m"]
            if "damaged" in (d.get("message") or ""):
                seen.append(d["message"])
            return bool(seen) and d["state"] == D and not target.is_symlink() and target.read_bytes() == data

        wait_until(repaired, timeout=30, what="the link found by the size check and the file repaired")
        assert "damaged: a file is missing or has the wrong size" in seen[0], seen
        assert target.parent.stat().st_ino == folder_ino  # repaired inside the folder pods mount
        assert outside.read_text() == "target secret-on-node\n"  # never written through the link
    finally:
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=20)
    assert "model damaged: repairing" in err


def test_restart_of_a_big_root_takes_seconds(tmp_path):
    """40 models of 2 GiB each (sparse files) with their manifests: a restart reports them all
    Downloaded from stats alone. Each manifest's xxh3 is wrong on purpose: a restart that hashed
    the files would find every model corrupt and start a download from its unreachable URI, so
    the states and the log prove no byte was hashed, with no clock in the test (it asserted
    < 15 s before: a timed assertion, which the house keeps out of tests)."""
    from modelcache.store import Manifest, ManifestFile, NodeStore

    root = tmp_path / "root"
    store = NodeStore.at(root)
    entries = []
    for i in range(40):
        uri = f"http://127.0.0.1:9/unreachable/m{i}.bin"
        key = storage_key(uri)
        folder = root / "models" / key
        folder.mkdir(parents=True)
        with open(folder / f"m{i}.bin", "wb") as f:
            f.truncate(2 << 30)
        manifest = Manifest(storage_key=key, uri=uri, resolved_uri=uri, revision=None,
                            files=[ManifestFile(path=f"m{i}.bin", size=2 << 30, xxh3="0" * 32)],
                            created_at="2026-01-01T00:00:00Z")
        path = store.layout.manifest_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(manifest.to_json())
        entries.append({"modelName": f"m{i}", "sourceModelUri": uri})
    spec = write_node(tmp_path / "node.yaml", entries)
    proc = run_agent(spec, root, "--verify-interval", "0", "--size-check-interval", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    st = status_of(spec)
    assert set(st["modelStatus"].values()) == {D} and len(st["modelStatus"]) == 40
    assert st["modelDetails"]["m7"]["bytesTotal"] == 2 << 30
    assert "download started" not in proc.stderr


def test_max_concurrent_models_is_honoured(nginx, tmp_path):
    uris = []
    for i in range(3):
        nginx.write(f"c/m{i}.bin", 400_000)
        uris.append(nginx.url(f"c/m{i}.bin"))
    nginx.set_limit_rate("c", 400_000)
    spec = write_node(tmp_path / "node.yaml", [{"modelName": f"m{i}", "sourceModelUri": u} for i, u in enumerate(uris)])
    proc = run_agent(spec, tmp_path / "root", "--max-concurrent-models", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [line.split('msg="', 1)[1].split('"', 1)[0] for line in proc.stderr.splitlines()
              if 'msg="download started"' in line or 'msg="download finished"' in line]
    assert events == ["download started", "download finished"] * 3


def test_full_disk_is_a_clear_error_and_other_models_stay(nginx, tmp_path):
    with mounted_tmpfs(tmp_path / "fs", "size=100m") as mnt:
        small = nginx.write("d/small.bin", 2 << 20).read_bytes()
        nginx.write("d/big.bin", 60 << 20)
        us, ub = nginx.url("d/small.bin"), nginx.url("d/big.bin")
        spec = write_node(tmp_path / "node.yaml", [{"modelName": "small", "sourceModelUri": us},
                                                    {"modelName": "big", "sourceModelUri": ub}])
        # A 64 MiB margin on a 100 MiB disk: the 2 MiB model fits, the 60 MiB one cannot.
        proc = run_agent(spec, mnt, "--space-margin", "64Mi")
        assert proc.returncode == 1
        st = status_of(spec)
        assert st["modelStatus"] == {"small": D, "big": E}
        msg = st["modelDetails"]["big"]["message"]
        assert "insufficient space: need 60.0 MiB, free" in msg and str(mnt) in msg, msg
        assert (mnt / "models" / storage_key(us) / "small.bin").read_bytes() == small
        assert not (mnt / "models" / storage_key(ub)).exists()
        assert nginx.bytes_served("d/big.bin") <= 1  # refused before downloading
        assert st["capacity"]["totalBytes"] == 100 << 20 and st["capacity"]["reservedBytes"] == 0


def test_repair_replaces_only_the_damaged_file_inside_the_same_folder(tmp_path):
    """A serving pod's subPath mount holds the model folder's inode: a repair must fix files inside
    that folder (the good ones untouched), never swap the folder for a new one."""
    from modelcache.store import NodeStore

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    good_data, bad_data = os.urandom(200_000), os.urandom(300_000)
    (src / "good.bin").write_bytes(good_data)
    (src / "sub" / "w.bin").write_bytes(bad_data)
    uri = f"file://{src}"
    key = storage_key(uri)
    root = tmp_path / "root"
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": uri}])
    assert run_agent(spec, root).returncode == 0
    folder = root / "models" / key
    good, bad = folder / "good.bin", folder / "sub" / "w.bin"
    inodes = (folder.stat().st_ino, (folder / "sub").stat().st_ino, good.stat().st_ino)
    bad_ino = bad.stat().st_ino
    pod_view = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # what a running pod's mount holds
    try:
        with open(bad, "r+b") as f:  # same size, one byte off: only the full verify sees it
            f.seek(1000)
            f.write(bytes([bad_data[1000] ^ 0xFF]))
        agent = subprocess.Popen(agent_cmd(spec, root, "--watch", "--verify-interval", "1"), cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: (status_of(spec)["modelDetails"]["m"].get("message") or "").startswith("repaired ")
                       and status_of(spec)["modelStatus"] == {"m": D}, timeout=40, what="repaired")
        finally:
            agent.send_signal(signal.SIGTERM)
            _, err = agent.communicate(timeout=20)
        assert bad.read_bytes() == bad_data and good.read_bytes() == good_data
        assert (folder.stat().st_ino, (folder / "sub").stat().st_ino, good.stat().st_ino) == inodes
        assert bad.stat().st_ino != bad_ino  # renamed into place, not rewritten under a reader
        assert os.fstat(pod_view).st_nlink > 0 and os.listdir(pod_view) == os.listdir(folder)
        assert 'msg="repaired in place"' in err and "replaced=sub/w.bin" in err and "replaced_count=1" in err
        assert NodeStore.at(root).verify(key) == []
        assert not (root / ".modelcache" / "repair" / key).exists()

        # A folder without its manifest (KServe's agent filled it, or the manifest was lost) is
        # adopted in place: only the file that differs (truncated here) is fetched into it.
        (root / ".modelcache" / "manifests" / f"{key}.json").unlink()
        os.truncate(good, 10)
        proc = run_agent(spec, root)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert good.read_bytes() == good_data and folder.stat().st_ino == inodes[0]
        assert os.fstat(pod_view).st_nlink > 0
        assert 'msg="adopting a model folder that has no manifest"' in proc.stderr
        assert "kept=1 " in proc.stderr and "fetch=1 fetch_files=good.bin" in proc.stderr
        assert NodeStore.at(root).is_present(key) and NodeStore.at(root).verify(key) == []
    finally:
        os.close(pod_view)


def test_first_take_of_a_root_that_modelcache_pull_filled_refuses_and_deletes_nothing(nginx, tmp_path):
    """D2: a standalone agent started on a root holding three CLI-pulled models, with a file that
    lists one, used to delete the other two at info level. It now refuses the first take (exit 2,
    one line naming the models and the way out), deletes nothing, and with --take-root deletes
    them, each deletion a warning. Later starts on its root need no flag."""
    from tests.pull_helpers import run_cli

    uris = []
    for n in range(3):
        nginx.write(f"cli/m{n}.bin", 1 << 20, seed=n + 1)
        uris.append(nginx.url(f"cli/m{n}.bin"))
    root = tmp_path / "root"
    for uri in uris:
        assert run_cli("pull", uri, "--root", str(root), "--progress", "none").returncode == 0
    spec = write_node(tmp_path / "one.yaml", [{"modelName": "m0", "sourceModelUri": uris[0]}])
    proc = run_agent(spec, root)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    keys = [storage_key(u) for u in uris]
    named = sorted((storage_key(u), u) for u in uris[1:])
    assert lines == [
        f"error: --root {root} holds 2 model(s) that no agent downloaded and {spec} does not list: "
        f"{named[0][0]} ({named[0][1]}), {named[1][0]} ({named[1][1]}). The standalone agent deletes every model "
        "its file does not "
        "list, so nothing was done: add them to the file, point --root at a folder of the agent's own, or pass "
        "--take-root to let it delete them"], proc.stderr
    assert all((root / "models" / k).is_dir() for k in keys)
    assert not spec.with_name(spec.name + ".status.yaml").exists()

    proc = run_agent(spec, root, "--take-root")
    assert proc.returncode == 0, proc.stderr
    deleted = [ln for ln in proc.stderr.splitlines() if 'msg="model deleted' in ln]
    assert len(deleted) == 2 and all("level=warning" in ln for ln in deleted), proc.stderr
    assert sorted(p.name for p in (root / "models").iterdir()) == [keys[0]]
    # The root is the agent's now: a model pulled into it by hand goes at the next start, without a flag.
    assert run_cli("pull", uris[1], "--root", str(root), "--progress", "none").returncode == 0
    assert run_agent(spec, root).returncode == 0
    assert sorted(p.name for p in (root / "models").iterdir()) == [keys[0]]


def test_a_root_the_file_lists_entirely_is_taken_without_a_flag(nginx, tmp_path):
    """CLI-pulled models that the file lists are adopted as they are (no download), no flag needed."""
    from tests.pull_helpers import run_cli

    nginx.write("cli/a.bin", 1 << 20)
    uri = nginx.url("cli/a.bin")
    root = tmp_path / "root"
    assert run_cli("pull", uri, "--root", str(root), "--progress", "none").returncode == 0
    nginx.clear_access_log()
    spec = write_node(tmp_path / "a.yaml", [{"modelName": "a", "sourceModelUri": uri}])
    proc = run_agent(spec, root)
    assert proc.returncode == 0, proc.stderr
    assert status_of(spec)["modelStatus"] == {"a": D} and nginx.access_log() == []
