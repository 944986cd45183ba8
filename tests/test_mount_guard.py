"""The CLI never replaces or deletes a model folder that a pod on this node mounts (issue 20, point 11).

A pod reads its model through a bind mount of ``models/<storageKey>`` (the kubelet's subPath
mount, and the container's own in its mount namespace). ``modelcache rm``, ``gc`` and a ``pull``
that replaces an unlisted folder used to delete or swap the folder regardless, leaving the pod on
a deleted, empty directory. These tests make the same mounts a kubelet makes (``mount --bind``),
in this mount namespace and in another one (``unshare --mount``, as a container has), and run
the CLI in a PID namespace of its own (``unshare --pid``, a container without hostPID) for the
case where it cannot see the node's mounts. Root is needed to mount.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.fixtures.http import random_bytes
from tests.helpers import require, require_tool
from tests.pull_helpers import cli_cmd, run_cli


@pytest.fixture
def pulled(tmp_path: Path) -> tuple[Path, str, Path]:
    require(os.geteuid() == 0, "root (to bind-mount a model folder as a kubelet does)")
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(random_bytes(200_000, seed=1))
    root = tmp_path / "root"
    proc = run_cli("pull", str(src), "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    return root, storage_key(str(src)), src


@pytest.fixture
def bind(tmp_path: Path) -> Iterator[list[Path]]:
    """Bind mounts made by the test (unmounted at the end, whatever happens)."""
    made: list[Path] = []
    yield made
    for target in reversed(made):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def _bind(src: Path, target: Path, made: list[Path]) -> None:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(src), str(target)], check=True, capture_output=True)
    made.append(target)


def _error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    return lines[0]


def test_rm_and_gc_leave_a_model_a_pod_mounts(pulled: tuple[Path, str, Path], bind: list[Path],
                                               tmp_path: Path) -> None:
    root, key, _ = pulled
    pod = tmp_path / "kubelet" / "pods" / "uid-1" / "volume-subpaths" / "models" / "server" / "0"
    _bind(root / "models" / key, pod, bind)
    line = _error(run_cli("rm", key, "--root", str(root)))
    assert f"model {key} is mounted at {pod}" in line and "stop it" in line
    assert NodeStore.at(root).is_present(key)
    # The mounted model is not counted as evictable: the target is out of reach, and even told to
    # evict everything, gc leaves it.
    assert "evicting every model not in use (0, 0 B)" in _error(run_cli("gc", "--target-free", "1000T", "--root",
                                                                          str(root)))
    proc = run_cli("gc", "--target-free", "1000T", "--evict-all", "--root", str(root))
    assert proc.returncode == 0 and "nothing to evict" in proc.stdout, proc.stdout + proc.stderr
    assert NodeStore.at(root).is_present(key)
    subprocess.run(["umount", str(pod)], check=True)
    bind.remove(pod)
    proc = run_cli("rm", key, "--root", str(root))
    assert proc.returncode == 0 and "removed" in proc.stdout, proc.stderr
    assert not (root / "models" / key).exists()


def test_a_mount_in_another_mount_namespace_counts_too(pulled: tuple[Path, str, Path], tmp_path: Path) -> None:
    """A container's view of the model is a mount in its own namespace: not in this process's
    mount table, only in that process's /proc/<pid>/mountinfo."""
    require_tool("unshare")
    root, key, _ = pulled
    target = tmp_path / "container-view"
    target.mkdir()
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         f"mount --bind '{root / 'models' / key}' '{target}' && echo ready && exec sleep 600"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        line = _error(run_cli("rm", key, "--root", str(root)))
        assert f"is mounted at {target} (pid {holder.pid})" in line
        assert NodeStore.at(root).is_present(key)
    finally:
        holder.kill()
        holder.wait()
    assert run_cli("rm", key, "--root", str(root)).returncode == 0
    assert not (root / "models" / key).exists()


def test_pull_adopts_an_unlisted_folder_a_pod_mounts_in_place(pulled: tuple[Path, str, Path], bind: list[Path],
                                                               tmp_path: Path) -> None:
    """An unlisted folder (KServe's agent filled it, or its manifest was lost) is no longer replaced
    whole: it is adopted in place (modelcache/adopt.py), so the folder a pod mounts stays, and only
    a file that differs is renamed into it."""
    root, key, src = pulled
    (root / ".modelcache" / "manifests" / f"{key}.json").unlink()
    folder = root / "models" / key
    ino = folder.stat().st_ino
    os.truncate(folder / "w.bin", 10)
    _bind(folder, tmp_path / "pod", bind)
    proc = run_cli("pull", str(src), "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    assert folder.stat().st_ino == ino and NodeStore.at(root).verify(key) == []
    assert (tmp_path / "pod" / "w.bin").read_bytes() == (src / "w.bin").read_bytes()  # what the pod sees


def test_cli_that_cannot_see_the_nodes_mounts_says_why_and_needs_assume_unused(
    pulled: tuple[Path, str, Path]
) -> None:
    """In its own PID namespace (a container without hostPID) the CLI cannot see the kubelet's
    mounts: it refused nothing before; now it refuses and names the flag."""
    require_tool("unshare")
    root, key, _ = pulled
    in_own_pid_ns = ["unshare", "--pid", "--fork", "--mount-proc", "--", *cli_cmd()]
    proc = subprocess.run([*in_own_pid_ns, "rm", key, "--root", str(root)], capture_output=True, text=True,
                          timeout=60)
    line = _error(proc)
    assert "cannot tell whether a pod on this node mounts" in line and "own PID namespace" in line
    assert "--assume-unused" in line and NodeStore.at(root).is_present(key)
    proc = subprocess.run([*in_own_pid_ns, "rm", key, "--root", str(root), "--assume-unused"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (root / "models" / key).exists()


def test_an_unreadable_process_counts_only_if_it_is_a_pods(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose mount table cannot be read hides mounts only if it may be a pod's: one in a
    kubelet's pod cgroup (``kubepods``, under either cgroup driver). On some machines even root may
    not read PID 1's namespaces; any unreadable process on a machine with /var/lib/kubelet used to
    make every ``rm`` refuse once a kubelet had run there (issue 24, item 9)."""
    from modelcache.store import mountusers

    require(os.geteuid() == 0, "root (to make cgroups)")
    from tests.cluster import cgroups

    tree = f"/modelcache-test-guard-{os.getpid()}/kubepods/besteffort/pod1"
    cgroups.make(tree)
    in_pod = subprocess.Popen(["sleep", "600"], preexec_fn=lambda: cgroups.join(tree))
    outside = subprocess.Popen(["sleep", "600"])
    try:
        folder = tmp_path / "models" / "k"
        folder.mkdir(parents=True)
        real_readlink = os.readlink
        hidden: set[int] = set()

        def readlink(path: str) -> str:
            if any(path == f"/proc/{pid}/ns/mnt" for pid in hidden):
                raise PermissionError(13, "Permission denied", path)
            return real_readlink(path)

        monkeypatch.setattr(mountusers.os, "readlink", readlink)
        hidden = {outside.pid}
        assert mountusers.mount_users(folder).unknown is None
        hidden = {outside.pid, in_pod.pid}
        unknown = mountusers.mount_users(folder).unknown
        assert unknown == "the mounts of 1 processes of pods on this node cannot be read (not root)"
    finally:
        for proc in (in_pod, outside):
            proc.kill()
            proc.wait()
        cgroups.remove(tree.split("/kubepods")[0])
