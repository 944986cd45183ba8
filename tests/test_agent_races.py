"""The agent's state machine under change (issue 21), in-process against nginx.

Each test drives one race of a kube-race review through the real ``Agent`` (real pulls into a
real store) with a stand-in for the pod check, which can report a mounting pod, fail, or hold
still until the test lets it go:
- F1: a download cancelled because its entry left the spec, then re-added, finishes;
- F2: an entry re-added while the removal checks for mounting pods is not deleted;
- F4: a download's preallocated files are not counted a second time against the next one;
- F6: staged, repair and trash folders of models no entry wants are collected, at start and later;
- F7: a stopping agent reports its downloads interrupted (Pending), not failed;
- and the derived state: a model deleted behind the agent's back is not reported Downloaded.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from agent.capacity import allocated_bytes
from agent.config import AgentConfig
from agent.core import Agent
from agent.credentials import Credentials
from agent.ports import EventSink, Ports
from modelcache.kube.types import LocalModelInfo
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)

D, DL, P, E = "ModelDownloaded", "ModelDownloading", "ModelDownloadPending", "ModelDownloadError"


class Mounts:
    """The pod check: reports ``pods[key]`` as mounting, raises ``fail``, or (``hold`` cleared)
    waits in the middle of the check until the test releases it."""

    def __init__(self) -> None:
        self.pods: dict[str, list[str]] = {}
        self.fail: Exception | None = None
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.calls = 0

    def users(self, keys: Any) -> dict[str, list[str]]:
        self.calls += 1
        self.entered.set()
        self.hold.wait(60)
        if self.fail is not None:
            raise self.fail
        return {k: self.pods[k] for k in keys if k in self.pods}


def make_agent(tmp_path: Path, mounts: Any = None, events: EventSink | None = None, **cfg: Any) -> Agent:
    settings: dict[str, Any] = dict(node="n", root=tmp_path / "root", port=-1, backoff_initial=0.2, backoff_max=1.0,
                                    status_interval=0.2, removal_recheck=0.2, chunk_size=1 << 20, workers=2,
                                    transfer_attempts=2, space_margin=0)
    settings.update(cfg)
    return Agent(AgentConfig(**settings), Credentials(None, {}), mounts or Mounts(), ports=Ports(events=events))


def info(name: str, uri: str) -> LocalModelInfo:
    return LocalModelInfo(model_name=name, source_model_uri=uri)


def states(agent: Agent) -> dict[str, str]:
    return dict(agent.status()["modelStatus"])


def detail(agent: Agent, name: str) -> dict[str, Any]:
    return dict(agent.status()["modelDetails"].get(name) or {})


@pytest.fixture
def slow(nginx: Any) -> Any:
    """nginx with ``/slow/`` throttled: a 2 MiB model takes a few seconds (two connections)."""
    nginx.set_limit_rate("slow", 300 << 10)
    return nginx


@pytest.mark.parametrize("hold", ["mounted", "check-fails"])
def test_download_cancelled_by_a_removal_then_readded_finishes(tmp_path, slow, hold):
    """F1: the entry leaves mid-download (the removal then waits: a pod mounts the folder, or the
    pod check fails) and comes back: the download starts again and ends Downloaded."""
    uri = slow.url("slow/a.bin")
    slow.write("slow/a.bin", 2 << 20)
    key = storage_key(uri)
    mounts = Mounts()
    if hold == "mounted":
        mounts.pods[key] = ["serving/pod-0"]
    else:
        mounts.fail = RuntimeError("API server unreachable")
    agent = make_agent(tmp_path, mounts).start()
    try:
        agent.set_spec([info("m", uri)])
        wait_until(lambda: (detail(agent, "m").get("bytesDone") or 0) > 0, timeout=60, what="download under way")
        agent.set_spec([])
        # The download stops; the removal waits for the pod (or for a pod check that works).
        wait_until(lambda: not agent.records[key].running and mounts.calls > 0, timeout=30, what="download stopped")
        if hold == "mounted":
            wait_until(lambda: "kept while mounted by serving/pod-0" in (detail(agent, "m").get("message") or ""),
                       timeout=10, what="removal waiting for the pod")
        agent.set_spec([info("m", uri)])
        wait_until(lambda: states(agent) == {"m": D}, timeout=60, what="re-added model downloaded")
        assert NodeStore.at(tmp_path / "root").is_present(key)
    finally:
        agent.stop()


def test_entry_readded_during_the_pod_check_is_not_deleted(tmp_path, nginx):
    """F2: the in-use check's "nobody mounts it" is applied only if the spec still says remove."""
    data = nginx.write("f/a.bin", 1 << 20).read_bytes()
    uri = nginx.url("f/a.bin")
    key = storage_key(uri)
    mounts = Mounts()
    agent = make_agent(tmp_path, mounts)  # ticks driven by the test: the check can be held in the middle
    try:
        agent.set_spec([info("m", uri)])
        wait_until(lambda: (agent.tick(), states(agent))[1] == {"m": D}, timeout=30, what="downloaded")
        agent.set_spec([])
        mounts.hold.clear()
        mounts.entered.clear()
        ticking = threading.Thread(target=agent.tick)
        ticking.start()
        assert mounts.entered.wait(10), "the removal did not check for mounting pods"
        agent.set_spec([info("m", uri)])  # back while the check runs
        mounts.hold.set()
        ticking.join(30)
        agent.tick()
        assert states(agent) == {"m": D}
        assert (tmp_path / "root" / "models" / key / "a.bin").read_bytes() == data
        assert NodeStore.at(tmp_path / "root").is_present(key)
    finally:
        mounts.hold.set()
        agent.stop()


def test_preallocated_download_is_not_counted_twice_against_the_next(tmp_path, slow):
    """F4: on a 5 MiB disk, model A (2 MiB) has preallocated its file and B (2 MiB) still fits:
    A's reservation no longer counts the bytes that free space already shows as used."""
    slow.write("slow/a.bin", 2 << 20)
    slow.write("slow/b.bin", 2 << 20)
    ua, ub = slow.url("slow/a.bin"), slow.url("slow/b.bin")
    root = tmp_path / "root"
    disk = 5 << 20
    failures: list[str] = []
    agent = make_agent(tmp_path, space_margin=512 << 10, events=lambda kind, reason, message: failures.append(
        message) if reason == "DownloadFailed" else None)
    agent.capacity._disk_usage = lambda _p: (disk, disk - allocated_bytes(root))  # a 5 MiB file system
    agent.start()
    try:
        agent.set_spec([info("a", ua)])
        staged_a = root / ".modelcache" / "staging" / storage_key(ua)
        wait_until(lambda: allocated_bytes(staged_a) >= 2 << 20 and states(agent)["a"] == DL, timeout=30,
                   what="A preallocated and downloading")
        agent.set_spec([info("a", ua), info("b", ub)])
        wait_until(lambda: states(agent) == {"a": D, "b": D} or E in states(agent).values(), timeout=90,
                   what="both downloaded")
        assert states(agent) == {"a": D, "b": D}, (agent.status()["modelDetails"], failures)
        assert failures == []
    finally:
        agent.stop()


def test_orphaned_staging_repair_and_trash_are_collected_at_start_and_later(tmp_path, nginx):
    """F6: folders of models no entry wants, left by a crash or while the agent was down, are
    freed when the first spec arrives and by the periodic sweep afterwards."""
    root = tmp_path / "root"
    meta = root / ".modelcache"
    orphans = {
        "staged": meta / "staging" / "0123456789abcdef" / "data" / "w.bin",  # a killed download
        "repair": meta / "repair" / "1111111111111111" / "x.bin",  # a killed repair
        "trash": meta / "staging" / ".trash-2222222222222222-1" / "y.bin",  # a killed delete
    }
    # A folder nothing of ours records (a KServe copy, a user's files): never collected (issue 27).
    foreign = root / "models" / "3333333333333333" / "z.bin"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"k" * 1000)
    for path in orphans.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(1 << 20)
    nginx.write("f/a.bin", 1 << 20)
    uri = nginx.url("f/a.bin")
    agent = make_agent(tmp_path, sweep_interval=0.3).start()
    try:
        agent.set_spec([info("m", uri)])
        wait_until(lambda: states(agent) == {"m": D}, timeout=30, what="wanted model downloaded")
        wait_until(lambda: not any(p.exists() for p in orphans.values()), timeout=30, what="orphans collected")
        assert not (meta / "staging" / "0123456789abcdef").exists()
        assert not (meta / "repair" / "1111111111111111").exists()
        assert foreign.read_bytes() == b"k" * 1000
        assert (root / "models" / storage_key(uri) / "a.bin").exists()
        # Later: a download killed by another process on this root, a delete interrupted by a crash.
        late = meta / "staging" / "4444444444444444" / "data" / "w.bin"
        late.parent.mkdir(parents=True)
        late.write_bytes(b"x" * 1000)
        trash = root / "models" / ".trash-5555555555555555-9"
        trash.mkdir()
        wait_until(lambda: not late.parent.parent.exists() and not trash.exists(), timeout=30,
                   what="later orphans collected by the sweep")
        assert states(agent) == {"m": D}
        assert foreign.read_bytes() == b"k" * 1000  # sweeps later on leave it too
    finally:
        agent.stop()


def test_stopping_agent_reports_interrupted_not_failed(tmp_path, slow):
    """F7: downloads cancelled by the agent's own stop are Pending ("interrupted"), count no
    failure and emit no DownloadFailed event; the next agent resumes from the staged data."""
    slow.write("slow/a.bin", 2 << 20)
    uri = slow.url("slow/a.bin")
    events: list[tuple[str, str]] = []
    agent = make_agent(tmp_path, events=lambda kind, reason, _message: events.append((kind, reason)))
    agent.start()
    agent.set_spec([info("m", uri)])
    wait_until(lambda: (detail(agent, "m").get("bytesDone") or 0) > 0, timeout=60, what="download under way")
    agent.stop()
    assert states(agent) == {"m": P}
    assert "interrupted" in detail(agent, "m")["message"]
    assert events == []
    assert "modelcache_agent_errors_total{" not in agent.metrics.render().decode()
    staged = tmp_path / "root" / ".modelcache" / "staging" / storage_key(uri)
    assert staged.exists()
    again = make_agent(tmp_path).start()
    try:
        again.set_spec([info("m", uri)])
        wait_until(lambda: states(again) == {"m": D}, timeout=60, what="resumed by the next agent")
    finally:
        again.stop()


def test_model_deleted_behind_the_agents_back_is_not_reported_downloaded(tmp_path, nginx):
    """The state is derived from the manifest on disk every time: a model removed by someone
    else (`modelcache rm`/`gc` on the root) stops being Downloaded at once and is fetched again."""
    nginx.write("f/a.bin", 1 << 20)
    uri = nginx.url("f/a.bin")
    key = storage_key(uri)
    agent = make_agent(tmp_path)  # ticks driven by the test
    try:
        agent.set_spec([info("m", uri)])
        wait_until(lambda: (agent.tick(), states(agent))[1] == {"m": D}, timeout=30, what="downloaded")
        assert NodeStore.at(tmp_path / "root").remove(key)
        assert states(agent) == {"m": P}
        wait_until(lambda: (agent.tick(), states(agent))[1] == {"m": D}, timeout=30, what="downloaded again")
        assert NodeStore.at(tmp_path / "root").is_present(key)
    finally:
        agent.stop()
