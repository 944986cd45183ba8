"""Node store: presence, atomic publish, crash recovery, rm, gc, verify; and the resume journal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelcache.engine.transfer import TransferOptions
from modelcache.pull import pull
from modelcache.sources.credentials import Settings
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from modelcache.store.journal import Journal, seal

OPTS = TransferOptions(workers=2, chunk_size=64 * 1024)


def make_model(folder: Path, sizes: dict[str, int]) -> Path:
    for rel, size in sizes.items():
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))
    return folder


@pytest.fixture
def pulled(tmp_path):
    src = make_model(tmp_path / "src", {"w.bin": 300_000, "cfg/config.json": 40})
    root = tmp_path / "root"
    res = pull(str(src), root=root, options=OPTS, settings=Settings.from_env({}))
    return NodeStore.at(root), res, src


def test_layout_and_manifest(pulled):
    store, res, src = pulled
    key = res.storage_key
    root = store.layout.root
    assert res.path == root / "models" / key
    assert (root / ".modelcache" / "manifests" / f"{key}.json").is_file()
    assert not (root / ".modelcache" / "staging" / key).exists()
    assert sorted(p.relative_to(res.path).as_posix() for p in res.path.rglob("*") if p.is_file()) == [
        "cfg/config.json", "w.bin"]  # nothing of ours inside the model folder
    m = store.manifest(key)
    assert m is not None and m.uri == str(src) and m.total_size == 300_040


def test_presence_needs_manifest_and_matching_sizes(pulled):
    store, res, _ = pulled
    key = res.storage_key
    assert store.is_present(key)
    with open(res.path / "w.bin", "ab") as f:
        f.write(b"x")
    assert not store.is_present(key)
    (res.path / "w.bin").unlink()
    assert not store.is_present(key)


def test_damaged_model_is_fetched_again(pulled):
    store, res, src = pulled
    (res.path / "cfg" / "config.json").unlink()
    again = pull(str(src), root=store.layout.root, options=OPTS, settings=Settings.from_env({}))
    assert not again.cached
    assert (again.path / "cfg" / "config.json").read_bytes() == (src / "cfg" / "config.json").read_bytes()
    assert store.verify(res.storage_key) == []


def test_verify_detects_a_flipped_byte(pulled):
    store, res, _ = pulled
    p = res.path / "w.bin"
    data = bytearray(p.read_bytes())
    data[12345] ^= 0x01
    p.write_bytes(bytes(data))
    problems = store.verify(res.storage_key)
    assert [pr.path for pr in problems] == ["w.bin"] and "xxh3-128" in problems[0].problem


def test_recover_finishes_an_interrupted_publish(pulled):
    store, res, _ = pulled
    key = res.storage_key
    staging = store.layout.staging_dir(key)
    staging.mkdir(parents=True)
    # The crash window: folder renamed into place, manifest still in staging.
    os.rename(store.layout.manifest_path(key), staging / "manifest.json")
    assert not store.is_present(key)
    store.recover(key)
    assert store.is_present(key) and not staging.exists()


def test_rm_and_gc(tmp_path):
    root = tmp_path / "root"
    keys = []
    for i in range(3):
        src = make_model(tmp_path / f"src{i}", {"w.bin": 100_000 * (i + 1)})
        keys.append(pull(str(src), root=root, options=OPTS, settings=Settings.from_env({})).storage_key)
        time.sleep(0.02)
    # The disk is shared with other processes: gc sees a fixed free-space reading here.
    class FixedFree(NodeStore):
        def free_bytes(self) -> int:
            return 1_000_000

    store = FixedFree(NodeStore.at(root).layout)
    os.utime(store.layout.manifest_path(keys[0]))  # model 0 used most recently
    dry = store.gc(1_000_000 + 250_000, dry_run=True)
    assert [e.storage_key for e in dry] == [keys[1], keys[2]]  # least recently used first
    assert all(store.is_present(k) for k in keys)
    evicted = store.gc(1_000_000 + 150_000)
    assert [e.storage_key for e in evicted] == [keys[1]]
    assert not store.is_present(keys[1]) and not (root / "models" / keys[1]).exists()
    assert store.remove(keys[2]) and not store.remove(keys[2])
    assert [e.storage_key for e in store.entries()] == [keys[0]]


def test_journal_trusts_unsynced_lines_only_in_the_same_boot(tmp_path):
    p = tmp_path / "journal"
    p.write_text(seal("boot other-boot\nc 0 0 4096\nS\nc 0 1 8192\nF 1 abc sha256\n"))
    j = Journal(str(p))
    st = j.load()
    assert st.chunks == {(0, 0): 4096} and st.files == {}  # after the last sync: not trusted
    j.open(fresh=False)
    j.chunk(0, 2, 100)
    j.file_done(3, "def", ("md5",))
    j.file_reset(0)
    j.close()
    st = j.load()
    assert st.chunks == {} and st.files == {3: ("def", ("md5",))}
    with open(p, "a") as f:
        f.write("c 1 1 77")  # torn last line
    assert (1, 1) not in j.load().chunks
    with open(p, "a") as f:  # a whole line with a damaged digit: its seal no longer matches
        f.write("\n" + seal("c 1 2 4096\n").replace("c 1 2", "c 1 3"))
    assert (1, 3) not in j.load().chunks and (1, 2) not in j.load().chunks


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "modelcache", *args], capture_output=True, text=True, timeout=120)


def test_cli_ls_verify_rm_gc_json(tmp_path):
    src = make_model(tmp_path / "src", {"a.bin": 200_000})
    root = str(tmp_path / "root")
    p = run_cli("pull", str(src), "--root", root, "--json", "--progress", "none")
    assert p.returncode == 0, p.stderr
    (result,) = json.loads(p.stdout)
    assert result["ok"] and result["storage_key"] == storage_key(str(src)) and not result["cached"]
    p = run_cli("pull", str(src), "--root", root, "--json")
    assert json.loads(p.stdout)[0]["cached"] is True
    ls = json.loads(run_cli("ls", "--root", root, "--json").stdout)
    assert [(e["storage_key"], e["present"], e["size"]) for e in ls] == [(storage_key(str(src)), True, 200_000)]
    v = run_cli("verify", "--root", root, "--json")
    assert v.returncode == 0 and json.loads(v.stdout) == {storage_key(str(src)): []}
    model = Path(root) / "models" / storage_key(str(src)) / "a.bin"
    model.write_bytes(b"\0" * 200_000)
    v = run_cli("verify", str(src), "--root", root)
    assert v.returncode == 1 and "a.bin: xxh3-128" in v.stdout
    g = run_cli("gc", "--root", root, "--target-free", "1T", "--evict-all", "--dry-run", "--json")
    assert [e["storage_key"] for e in json.loads(g.stdout)["evicted"]] == [storage_key(str(src))]
    assert model.exists()
    r = run_cli("rm", str(src), "--root", root, "--json")
    # A list of objects, as every other --json output (was {"<uri>": true}).
    assert json.loads(r.stdout) == [{"model": str(src), "storage_key": storage_key(str(src)), "removed": True,
                                     "made_by_modelcache": True}] and not model.exists()
    assert json.loads(run_cli("ls", "--root", root, "--json").stdout) == []


def test_admit_hook_sees_the_plan_and_can_refuse(tmp_path):
    from modelcache.errors import InsufficientSpaceError
    from modelcache.pull import PullPlan

    src = make_model(tmp_path / "src", {"a.bin": 150_000, "b/c.bin": 50_000})
    seen: list[PullPlan] = []

    def refuse(plan: PullPlan) -> None:
        seen.append(plan)
        raise InsufficientSpaceError(f"insufficient space: need {plan.bytes_needed}")

    with pytest.raises(InsufficientSpaceError, match="need 200000"):
        pull(str(src), root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}), admit=refuse)
    assert seen[0].total_bytes == 200_000 and seen[0].files == 2 and seen[0].storage_key == storage_key(str(src))
    assert not NodeStore.at(tmp_path / "root").is_present(storage_key(str(src)))
    res = pull(str(src), root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}), admit=seen.append)
    assert res.files == 2 and len(seen) == 2


def test_cancel_keeps_staging_and_never_publishes(tmp_path):
    import threading

    from modelcache.errors import ModelcacheError

    src = make_model(tmp_path / "src", {"a.bin": 4_000_000})
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(ModelcacheError, match="cancelled"):
        pull(str(src), root=tmp_path / "root", options=TransferOptions(workers=1, chunk_size=4096),
             settings=Settings.from_env({}), cancel=cancel)
    store = NodeStore.at(tmp_path / "root")
    assert not store.is_present(storage_key(str(src)))
    assert not (tmp_path / "root" / "models" / storage_key(str(src))).exists()
    res = pull(str(src), root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    assert (res.path / "a.bin").read_bytes() == (src / "a.bin").read_bytes()


def test_cancel_ends_the_wait_for_another_process_lock(tmp_path):
    """A pull waiting for the model lock that another process holds (a second agent, a CLI pull)
    returns at once when cancelled: a stopping agent is never stuck behind someone else's pull."""
    import threading

    from modelcache.errors import CancelledError

    src = make_model(tmp_path / "src", {"a.bin": 1000})
    key = storage_key(str(src))
    store = NodeStore.at(tmp_path / "root")
    cancel, outcome = threading.Event(), []

    def run() -> None:
        try:
            outcome.append(pull(str(src), root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}),
                                cancel=cancel))
        except BaseException as exc:
            outcome.append(exc)

    # The holder runs in a child process: flock locks belong to an open file, and the child's
    # lock is exactly what another process on the node would hold.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from modelcache.store import NodeStore\n"
        f"with NodeStore.at({str(tmp_path / 'root')!r}).lock({key!r}):\n"
        "    print('locked', flush=True); sys.stdin.read()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"locked"
        puller = threading.Thread(target=run)
        puller.start()
        puller.join(0.5)  # give it time to reach the lock; it must still be waiting there
        assert puller.is_alive() and not outcome
        cancel.set()
        puller.join(30)
        assert not puller.is_alive() and isinstance(outcome[0], CancelledError), outcome
    finally:
        holder.communicate(b"", timeout=10)
    assert not store.is_present(key)


def test_gc_clears_abandoned_staging_but_not_a_locked_or_fresh_one(tmp_path):
    root = tmp_path / "root"
    store = NodeStore.at(root)
    old, busy, fresh = (store.layout.staging_dir(k) for k in ("a" * 16, "b" * 16, "c" * 16))
    for folder in (old, busy, fresh):
        (folder / "data").mkdir(parents=True)
        (folder / "data" / "w.bin").write_bytes(b"x" * 1000)
    week_ago = time.time() - 7 * 24 * 3600
    for folder in (old, busy):
        for p in [folder, *folder.rglob("*")]:
            os.utime(p, (week_ago, week_ago))
    with store.lock("b" * 16):  # a pull resuming it right now
        store.gc(0)
    assert not old.exists() and busy.exists() and fresh.exists()


def test_progress_keeps_same_named_files_of_two_models_apart(tmp_path):
    from modelcache.pull import pull_many
    from modelcache.runtime.progress import ProgressTracker

    a = make_model(tmp_path / "a", {"config.json": 10, "w.bin": 300_000})
    b = make_model(tmp_path / "b", {"config.json": 20, "w.bin": 200_000})
    tracker = ProgressTracker()
    seen: list[tuple[str, ...]] = []
    orig = tracker.file_started

    def spy(key: str, total: int | None, already: int = 0, resumable: bool = True) -> None:
        orig(key, total, already, resumable)
        seen.append(tuple(f.path for f in tracker.snapshot().active))

    tracker.file_started = spy  # type: ignore[method-assign]
    results = pull_many([str(a), str(b)], root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}),
                        progress=tracker)
    assert all(not isinstance(r, BaseException) for r in results)
    snap = tracker.snapshot()
    assert (snap.files_done, snap.files_total, snap.bytes_done) == (4, 4, 500_030)
    assert all("\x00" not in p for labels in seen for p in labels)  # shown as plain paths
    assert max(len(labels) for labels in seen) >= 1
