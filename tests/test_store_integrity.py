"""The store's own integrity rules: what the journal trusts, what recover installs, which roots
it locks, and that extracted layouts are durable before their manifests.

Each test failed before the fix beside it (issue 20, points 5, 7, 8 and 12).
"""

from __future__ import annotations

import builtins
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelcache.engine.transfer import TransferOptions
from modelcache.pull import pull
from modelcache.sources.credentials import Settings
from modelcache.store import NodeStore
from modelcache.store import journal as journal_mod
from modelcache.store.journal import Journal
from tests.fixtures.http import random_bytes
from tests.helpers import require, require_tool
from tests.pull_helpers import run_cli

OPTS = TransferOptions(workers=2, chunk_size=64 * 1024)


def _no_boot_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc/sys/kernel/random/boot_id unreadable (a restricted /proc, some sandboxes)."""
    real_open = builtins.open

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file).endswith("kernel/random/boot_id"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(journal_mod, "open", fake_open, raising=False)


def test_unreadable_boot_id_never_makes_unsynced_lines_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point 5: the fallback id "unknown" equalled itself after a reboot, so every unsynced line of
    the last boot was trusted and zeros that never reached the disk were resumed as data."""
    _no_boot_id(monkeypatch)
    j = Journal(str(tmp_path / "journal"))
    j.open(fresh=True)
    j.chunk(0, 0, 4096)
    j.synced()  # covers the first line only
    j.chunk(0, 1, 8192)
    j.file_done(1, "abc", ("sha256",))
    j.close()
    # The next run (after a reboot or not: nothing can tell) trusts what the sync mark covers.
    state = Journal(str(tmp_path / "journal")).load()
    assert state.chunks == {(0, 0): 4096}
    assert state.files == {}


def test_journal_of_an_older_version_with_boot_unknown_is_not_trusted_past_its_marks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_boot_id(monkeypatch)
    p = tmp_path / "journal"
    p.write_text(journal_mod.seal("\nboot unknown\nc 0 0 4096\nS 1\nc 0 1 100\n"))
    assert Journal(str(p)).load().chunks == {(0, 0): 4096}


# ---- recover() (point 8) ---------------------------------------------------------------------


def _pulled(tmp_path: Path) -> tuple[NodeStore, str, Path]:
    src = tmp_path / "src"
    (src / "cfg").mkdir(parents=True)
    (src / "w.bin").write_bytes(random_bytes(300_000, seed=1))
    (src / "cfg" / "config.json").write_bytes(b'{"v": 1}')
    root = tmp_path / "root"
    res = pull(str(src), root=root, options=OPTS, settings=Settings.from_env({}))
    return NodeStore.at(root), res.storage_key, src


def test_recover_never_installs_a_pending_manifest_that_does_not_describe_the_folder(tmp_path: Path) -> None:
    """A publish crashed before its manifest (pending manifest A in staging); then an in-place
    repair moved the folder to revision B with files of the same sizes, and B's manifest was lost
    too. ``recover`` installed A over B's files: "present", with wrong digests and revision.
    Now A stays the store's record of the folder, marked damaged with the file that differs (never
    present, never a reason to adopt the folder on sizes), and the next pull fetches that file."""
    store, key, src = _pulled(tmp_path)
    staging = store.layout.staging_dir(key)
    staging.mkdir(parents=True)
    os.rename(store.layout.manifest_path(key), staging / "manifest.json")  # manifest A, pending
    folder = store.layout.model_dir(key)
    (folder / "w.bin").write_bytes(random_bytes(300_000, seed=2))  # revision B, same size
    assert not store.is_present(key)
    store.recover(key)
    assert not store.is_present(key)
    damage = store.damage(key)
    assert damage is not None and damage.files == ("w.bin",)
    assert not staging.exists(), "the stale pending manifest is not left for the next recover"
    res = pull(str(src), root=store.layout.base, options=OPTS, settings=Settings.from_env({}))
    assert res.refetched == ("w.bin",) and not res.cached
    assert (folder / "w.bin").read_bytes() == (src / "w.bin").read_bytes()
    assert store.is_present(key) and store.verify(key) == [] and store.damage(key) is None


def test_recover_still_finishes_the_publish_it_is_for(tmp_path: Path) -> None:
    store, key, _ = _pulled(tmp_path)
    staging = store.layout.staging_dir(key)
    staging.mkdir(parents=True)
    os.rename(store.layout.manifest_path(key), staging / "manifest.json")
    store.recover(key)
    assert store.is_present(key) and store.verify(key) == [] and not staging.exists()


def test_in_place_repair_drops_a_pending_manifest_left_in_staging(tmp_path: Path) -> None:
    """The agent's repair never touched ``staging/<key>``, so the stale pending manifest stayed for
    a later ``recover`` (a CLI pull on the agent's root) to install."""
    store, key, _ = _pulled(tmp_path)
    manifest = store.manifest(key)
    assert manifest is not None
    staging = store.layout.staging_dir(key)
    staging.mkdir(parents=True)
    (staging / "manifest.json").write_text(manifest.to_json())  # left by a crashed publish
    store.layout.manifest_path(key).unlink()  # damaged: the agent took the manifest away
    staged = tmp_path / "staged"
    shutil.copytree(store.layout.model_dir(key), staged)
    store.install_in_place(key, staged, manifest, [f.path for f in manifest.files])
    assert store.is_present(key)
    assert not staging.exists()


# ---- locks that other hosts ignore (point 7) -------------------------------------------------

# mountinfo lines as the kernel writes them (NFS cannot be mounted on these machines: the kernel
# has no nfs client, see /proc/filesystems; FUSE can, see the bindfs test below).
_NFS = "101 27 0:51 / {mp} rw,relatime shared:60 - nfs server:/export rw,vers=3,{opt},proto=tcp,addr=10.0.0.2"
_NFS4 = "102 27 0:52 / {mp} rw,relatime shared:61 - nfs4 server:/export rw,vers=4.2,{opt},clientaddr=10.0.0.3"
_CIFS = "103 27 0:53 / {mp} rw,relatime - cifs //srv/share rw,vers=3.1.1,{opt},uid=0"
_FUSE = "104 27 0:54 / {mp} rw,nosuid,nodev,relatime - fuse.sshfs host:/models rw,user_id=0,group_id=0"
_EXT4 = "105 27 253:1 / {mp} rw,relatime - ext4 /dev/vdb rw"


@pytest.mark.parametrize(("line", "opt", "refused"), [
    (_NFS, "nolock", "NFS mounted with 'nolock'"),
    (_NFS, "local_lock=all", "local_lock=all"),
    (_NFS4, "local_lock=flock", "local_lock=flock"),
    (_NFS, "local_lock=none", None),
    (_NFS4, "local_lock=posix", None),
    (_CIFS, "nobrl", "cifs mounted with 'nobrl'"),
    (_CIFS, "cache=strict", None),
    (_FUSE, "", "FUSE file system (fuse.sshfs)"),
    (_EXT4, "", None),
])
def test_store_refuses_to_lock_a_root_whose_locks_other_hosts_ignore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, opt: str, refused: str | None
) -> None:
    """All mutual exclusion is flock: on a shared root whose flock stays on each host, a second
    host rmtree'd the first one's staging and the first published the second one's half-written
    files under its own manifest."""
    from modelcache.errors import StoreError
    from modelcache.store import mountinfo as mountinfo_mod

    root = tmp_path / "shared" / "root"
    root.mkdir(parents=True)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("27 1 253:0 / / rw,relatime - ext4 /dev/vda rw\n"
                         + line.format(mp=str(tmp_path / "shared").replace(" ", "\\040"), opt=opt) + "\n")
    monkeypatch.setattr(mountinfo_mod, "MOUNTINFO", str(mountinfo))
    store = NodeStore.at(root)
    if refused is None:
        with store.lock("0123456789abcdef"):
            pass
        return
    expected = rf"refusing to write the store at '{re.escape(str(root))}': .*{re.escape(refused)}.*SINGLE_HOST_ROOT=1"
    with pytest.raises(StoreError, match=expected), store.lock("0123456789abcdef"):
        pass
    monkeypatch.setenv("MODELCACHE_SINGLE_HOST_ROOT", "1")  # the operator says only this host writes it
    with store.lock("0123456789abcdef"):
        pass


@pytest.fixture
def fuse_root(tmp_path: Path) -> Iterator[Path]:
    """A real FUSE mount (bindfs over a folder): the kernel's locks there are this host's only."""
    import subprocess

    require(os.geteuid() == 0 and os.path.exists("/dev/fuse"), "root and /dev/fuse (to mount FUSE)")
    bindfs = require_tool("bindfs")
    under, mnt = tmp_path / "under", tmp_path / "fuse"
    under.mkdir()
    mnt.mkdir()
    subprocess.run([bindfs, str(under), str(mnt)], check=True, capture_output=True)
    try:
        yield mnt
    finally:
        subprocess.run(["fusermount", "-u", str(mnt)], capture_output=True)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_cli_pull_into_a_fuse_root_is_refused_with_the_fix_then_allowed_when_single_host(
    fuse_root: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(random_bytes(100_000, seed=3))
    env = {k: v for k, v in os.environ.items() if k != "MODELCACHE_SINGLE_HOST_ROOT"}
    proc = run_cli("pull", str(src), "--root", str(fuse_root / "root"), env=env)
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "FUSE file system (fuse" in lines[0] and "MODELCACHE_SINGLE_HOST_ROOT=1" in lines[0], \
        proc.stderr
    assert not (fuse_root / "root" / "models").exists()
    proc = run_cli("pull", str(src), "--root", str(fuse_root / "root"), env={**env, "MODELCACHE_SINGLE_HOST_ROOT": "1"})
    assert proc.returncode == 0, proc.stderr
    ls = run_cli("ls", "--root", str(fuse_root / "root"), env=env)  # reading takes no lock: never refused
    assert ls.returncode == 0 and "present" in ls.stdout


# ---- extracted layouts are durable before their manifest (point 12) ------------------------------
# A power loss cannot be made here (no dm-flakey or dm-log-writes: this kernel has no device
# mapper), so the tests check the order of what the kernel is asked: every extracted file
# fsynced before the manifest (or unpacked.json) that vouches for it.


def _fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths of every fsync'ed descriptor, in order."""
    events: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        try:
            events.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            events.append("?")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return events


def _first(events: list[str], suffix: str) -> int:
    hits = [i for i, e in enumerate(events) if e.endswith(suffix)]
    assert hits, f"never fsynced: ...{suffix}"
    return hits[0]


def test_oci_modelcar_files_are_fsynced_before_the_manifest(
    oci_registry: Any, oci_repo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.fixtures.oci import LAYER_TGZ, make_tar

    files = {"config.json": b'{"v": 1}', "w/model.safetensors": random_bytes(300_000, seed=4)}
    layer = make_tar([(f"models/{k}", v) for k, v in files.items()], gzip_it=True)
    oci_registry.push_image(oci_repo, "v1", [(layer, LAYER_TGZ)])
    uri = f"oci+fetch://{oci_registry.host}/{oci_repo}:v1"
    env = {"KSERVE_OCI_INSECURE_REGISTRY": "true", "KSERVE_OCI_DOCKER_CONFIG": str(tmp_path / "none.json")}
    events = _fsyncs(monkeypatch)
    res = pull(uri, root=tmp_path / "root", settings=Settings.from_env(env), options=OPTS)
    manifest_at = _first(events, f"/staging/{res.storage_key}/.manifest.json.tmp")  # the pending manifest
    for rel in files:
        assert _first(events, f"/staging/{res.storage_key}/data/{rel}") < manifest_at, rel


def test_an_archive_unpacked_into_a_store_root_is_fsynced_before_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33, F6: ``pull file://.../m.tar --root`` fsynced the manifest and never the unpacked
    files (the review wrapped os.fsync the same way and saw only the manifest)."""
    from tests.archive_util import make_tar, tar_file

    src = tmp_path / "src"
    src.mkdir()
    files = {"m/w.bin": random_bytes(200_000, seed=7), "m/c.json": b'{"c": 1}'}
    make_tar(src / "m.tar", [tar_file(rel, data) for rel, data in files.items()], "w")
    events = _fsyncs(monkeypatch)
    res = pull(f"file://{src}/m.tar", root=tmp_path / "root", settings=Settings.from_env({}), options=OPTS)
    assert res.unpacked_from == "m.tar"
    manifest_at = _first(events, f"/staging/{res.storage_key}/.manifest.json.tmp")
    for rel in files:
        assert _first(events, f"/staging/{res.storage_key}/data/{rel}") < manifest_at, rel


def test_unpacked_archive_files_are_fsynced_before_their_record(
    nginx: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from initializer.dispatch import Context, run_pair
    from modelcache.runtime.progress import ProgressTracker
    from modelcache.sources.archive import ArchiveLimits
    from tests.archive_util import make_tar, tar_file

    make_tar(nginx.docroot / "a/model.tar.gz", [tar_file("m/w.bin", random_bytes(200_000, seed=5)),
                                                tar_file("m/cfg.json", b"{}")], "w:gz")
    os.chmod(nginx.docroot / "a/model.tar.gz", 0o644)
    events = _fsyncs(monkeypatch)
    dest = tmp_path / "dest"
    ctx = Context(Settings.from_env({}), ArchiveLimits.from_env({}), ProgressTracker())
    run_pair(nginx.url("a/model.tar.gz"), dest, ctx)
    from modelcache.sources.uri import storage_key

    record_at = _first(events, f"/.modelcache/unpacked/.{storage_key(nginx.url('a/model.tar.gz'))}.json.tmp")
    for rel in ("m/w.bin", "m/cfg.json"):
        assert _first(events, f"/dest/{rel}") < record_at, rel
