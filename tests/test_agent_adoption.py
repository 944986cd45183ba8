"""The switch-over on one node, in-process (the real ``Agent``, real pulls into a real store, nginx
behind a fault proxy): a folder KServe's agent filled and reported ``ModelDownloaded`` is carried
over (issue 26, M1-M3 of the KServe v0.20 audit).

- M1: the model counts as downloaded from the first status on, while it is verified in place
  (``verification: Verifying``), so the cache's copies and the placement label never drop;
- M2: a source that cannot be listed (credentials not copied yet, an unreachable origin, a URI
  modelcache refuses) leaves it counted (``Unverified``, with why), and it is verified as soon as
  the source answers;
- M3: what differs from the source is kept as found and reported as drift, never rewritten;
- a folder nothing vouches for (not reported Downloaded) is completed as before, and a carried
  folder that vanished is downloaded like any missing model;
- a namespace cache's entry counts too, from the first status on: its credentials are judged
  before the spec is applied (agent/entries.py), never after the verification has started.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agent.config import AgentConfig
from agent.core import Agent
from agent.credentials import Credentials
from agent.inuse import NoMounts
from modelcache.kube.types import LocalModelInfo
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.faultproxy import Fault, FaultProxy
from tests.fixtures.http import NginxServer
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)

D, DL, P, E = "ModelDownloaded", "ModelDownloading", "ModelDownloadPending", "ModelDownloadError"


def make_agent(tmp_path: Path, credentials: Credentials | None = None) -> Agent:
    cfg = AgentConfig(node="n", root=tmp_path / "root", port=-1, backoff_initial=0.2, backoff_max=0.5,
                      status_interval=0.2, chunk_size=1 << 20, workers=2, transfer_attempts=1, space_margin=0)
    return Agent(cfg, credentials or Credentials(None, {}), NoMounts())


class HeldChecks(Credentials):
    """No cluster's credentials (every entry may be served, as in the tests above), but each
    credential check the agent's supervisor thread makes waits until the test lets one pass
    (``release``): the test holds the supervisor between two of its steps. ``entered`` counts the
    supervisor's checks begun; ``refuse`` names entries refused (checked on any thread)."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        super().__init__(None, {})
        self.entered, self.refuse = 0, refuse
        self._passes = threading.Semaphore(0)

    def release(self) -> None:
        self._passes.release()

    def entry_refusal(self, info: LocalModelInfo, primary: LocalModelInfo) -> str | None:
        if threading.current_thread().name == "agent-supervisor":
            self.entered += 1
            assert self._passes.acquire(timeout=60), "the test never let the supervisor's check pass"
        return f"{info.status_key}: not granted" if info.status_key in self.refuse else None


def serve(nginx: NginxServer, rel: str, data: bytes) -> None:
    digest = base64.b64encode(hashlib.sha256(data).digest()).decode()
    nginx.write(rel, data, headers={"Repr-Digest": f"sha-256=:{digest}:"})


def kserve_fill(root: Path, uri: str, data: bytes) -> Path:
    folder = root / "models" / storage_key(uri)
    folder.mkdir(parents=True)
    (folder / uri.rsplit("/", 1)[-1]).write_bytes(data)
    return folder


def detail(agent: Agent, name: str) -> dict[str, Any]:
    return dict(agent.status()["modelDetails"][name])


def condition(agent: Agent) -> dict[str, Any] | None:
    found = [c for c in agent.status().get("conditions") or [] if c["type"] == "ModelsVerified"]
    return found[0] if found else None


def origin_bytes(proxy: FaultProxy, rel: str) -> int:
    """Body bytes of ``rel`` beyond the listing's probes (a ``Range: bytes=0-0`` GET telling
    whether the server takes ranges): what a download would have read."""
    return sum(r.bytes_sent for r in proxy.records if r.path.endswith(rel) and r.range != "bytes=0-0" and not r.fault)


def test_a_copy_kserve_reported_downloaded_counts_while_it_is_verified_and_its_origin_is_unreachable(
    nginx: NginxServer, tmp_path: Path
) -> None:
    data = os.urandom(3 << 20)
    serve(nginx, "m1/model.bin", data)
    host, port = nginx.url("").split("//")[1].split("/")[0].split(":")
    with FaultProxy((host, int(port))) as proxy:
        uri = proxy.url("m1/model.bin")
        folder = kserve_fill(tmp_path / "root", uri, data)
        # The origin refuses every request (credentials not copied yet, say).
        refuse = proxy.add(Fault("status", path_pattern="model.bin", method=None, times=None, status=403))
        agent = make_agent(tmp_path)
        try:
            agent.set_spec([LocalModelInfo(model_name="llama", source_model_uri=uri)], reported={"llama": D})
            # From the first status on (before any attempt): downloaded, verifying, its size known
            # (it counts against the node group's storageLimit: a stat of the folder, no hashing).
            assert agent.status()["modelStatus"] == {"llama": D}
            assert detail(agent, "llama")["verification"] == "Verifying"
            assert detail(agent, "llama")["bytesTotal"] == len(data) and agent.used_bytes() == len(data)
            agent.start()
            wait_until(lambda: detail(agent, "llama").get("verification") == "Unverified", timeout=30,
                       what="the unverified copy")
            d = detail(agent, "llama")
            assert agent.status()["modelStatus"] == {"llama": D}
            assert "unverified" in d["message"] and "403" in d["message"], d
            cond = condition(agent)
            assert cond is not None and cond["status"] == "False" and cond["reason"] == "Unverified"
            assert "llama" in cond["message"]
            # Every retry keeps it counted: it never goes Error or Pending.
            seen, target, deadline = set(), refuse.applied + 3, time.monotonic() + 30
            while refuse.applied < target and time.monotonic() < deadline:
                seen.add(agent.status()["modelStatus"]["llama"])
                time.sleep(0.02)
            assert refuse.applied >= target and seen == {D}
            # The origin answers: verified in place, no byte of the model read from it.
            proxy.clear()
            wait_until(lambda: NodeStore.at(tmp_path / "root").is_present(storage_key(uri)), timeout=30,
                       what="the verified copy")
            wait_until(lambda: "verification" not in detail(agent, "llama"), timeout=10, what="verified")
            assert agent.status()["modelStatus"] == {"llama": D} and condition(agent) is None
            assert origin_bytes(proxy, "model.bin") == 0
            assert (folder / "model.bin").read_bytes() == data
        finally:
            agent.stop()


def test_while_the_copy_is_hashed_it_counts_as_downloaded(nginx: NginxServer, tmp_path: Path) -> None:
    data = os.urandom(2 << 20)
    serve(nginx, "m2/model.bin", data)
    host, port = nginx.url("").split("//")[1].split("/")[0].split(":")
    with FaultProxy((host, int(port))) as proxy:
        uri = proxy.url("m2/model.bin")
        kserve_fill(tmp_path / "root", uri, data)
        proxy.pause()  # the verification's listing waits here
        agent = make_agent(tmp_path)
        try:
            agent.set_spec([LocalModelInfo(model_name="m", source_model_uri=uri, namespace="team")],
                           reported={"team/m": D})
            assert agent.status()["modelStatus"] == {"team/m": D}  # the first status (a write may follow at once)
            agent.start()
            wait_until(lambda: agent.records[storage_key(uri)].task is not None, timeout=10, what="the verification")
            assert agent.status()["modelStatus"] == {"team/m": D}
            assert detail(agent, "team/m")["verification"] == "Verifying"
            assert condition(agent)["reason"] == "Verifying"
            proxy.resume()
            wait_until(lambda: "verification" not in detail(agent, "team/m"), timeout=30, what="verified")
            assert NodeStore.at(tmp_path / "root").verify(storage_key(uri)) == []
        finally:
            proxy.resume()
            agent.stop()


def test_a_namespace_entry_counts_while_the_supervisor_has_started_the_verification_and_not_checked_it(
    nginx: NginxServer, tmp_path: Path
) -> None:
    """The order behind the flake of the test above (at load ~5): the supervisor's tick starts the
    verification (the record's task set) and only then checks the entries' credentials; a status
    read in between said ModelDownloadPending ("checking the credentials it names"). Held here
    with the supervisor inside that check."""
    data = os.urandom(1 << 20)
    serve(nginx, "m6/model.bin", data)
    host, port = nginx.url("").split("//")[1].split("/")[0].split(":")
    with FaultProxy((host, int(port))) as proxy:
        uri = proxy.url("m6/model.bin")
        kserve_fill(tmp_path / "root", uri, data)
        proxy.pause()  # the verification's listing waits here
        checks = HeldChecks()
        agent = make_agent(tmp_path, checks)
        try:
            agent.set_spec([LocalModelInfo(model_name="m", source_model_uri=uri, namespace="team")],
                           reported={"team/m": D})
            agent.start()
            wait_until(lambda: checks.entered == 1, timeout=10, what="the supervisor's credential check")
            assert agent.records[storage_key(uri)].task is not None  # started in the same tick, before it
            assert agent.status()["modelStatus"] == {"team/m": D}
            for _ in range(10):  # this check and the next ones pass
                checks.release()
            proxy.resume()
            wait_until(lambda: "verification" not in detail(agent, "team/m"), timeout=30, what="verified")
            assert agent.status()["modelStatus"] == {"team/m": D}
        finally:
            for _ in range(10):
                checks.release()
            proxy.resume()
            agent.stop()


def test_an_entry_a_spec_brings_during_the_supervisors_credential_check_keeps_its_verdict(tmp_path: Path) -> None:
    """The supervisor re-checks every entry it listed; an entry set_spec judged meanwhile (not in
    that list) keeps set_spec's verdict when the check's results are stored, and a refused entry
    is an error from the first status on, never counted."""
    uris = {name: f"http://127.0.0.1:9/{name}/model.bin" for name in ("a", "b", "c")}  # nothing listens
    for uri in uris.values():
        kserve_fill(tmp_path / "root", uri, os.urandom(1000))
    entries = {name: LocalModelInfo(model_name=name, source_model_uri=uri, namespace="team")
               for name, uri in uris.items()}
    reported = {f"team/{name}": D for name in uris}
    checks = HeldChecks(refuse=("team/c",))
    agent = make_agent(tmp_path, checks)
    try:
        agent.set_spec([entries["a"]], reported=reported)
        agent.start()
        wait_until(lambda: checks.entered == 1, timeout=10, what="the supervisor's check of team/a")
        agent.set_spec(list(entries.values()), reported=reported)  # while that check is held
        assert agent.status()["modelStatus"] == {"team/a": D, "team/b": D, "team/c": E}
        checks.release()  # the check of team/a ends and its results are stored; the next tick's
        wait_until(lambda: checks.entered == 2, timeout=10, what="the next check")  # waits inside
        status = agent.status()
        assert status["modelStatus"] == {"team/a": D, "team/b": D, "team/c": E}, status["modelDetails"]
        assert "not granted" in detail(agent, "team/c")["message"]
    finally:
        for _ in range(10):
            checks.release()
        agent.stop()


def test_a_copy_of_a_replaced_http_file_is_kept_and_reported_as_drift(nginx: NginxServer, tmp_path: Path) -> None:
    old, new = os.urandom(1 << 20), os.urandom(1 << 20)
    serve(nginx, "m3/model.bin", new)  # replaced at the origin after KServe downloaded `old`
    uri = nginx.url("m3/model.bin")
    folder = kserve_fill(tmp_path / "root", uri, old)
    nginx.clear_access_log()
    agent = make_agent(tmp_path)
    try:
        agent.set_spec([LocalModelInfo(model_name="m", source_model_uri=uri)], reported={"m": D})
        agent.start()
        wait_until(lambda: "verification" not in detail(agent, "m"), timeout=30, what="adopted")
        d = detail(agent, "m")
        assert agent.status()["modelStatus"] == {"m": D}
        assert "model.bin" in d["drift"] and "kept as found" in d["drift"], d
    finally:
        agent.stop()
    assert (folder / "model.bin").read_bytes() == old  # not rewritten under the pods
    assert sum(e.bytes_sent for e in nginx.requests_for("m3/model.bin") if e.range != "bytes=0-0") == 0


def test_a_folder_not_reported_downloaded_is_completed_and_a_refused_uri_is_served_unverified(
    nginx: NginxServer, tmp_path: Path
) -> None:
    data = os.urandom(1 << 20)
    serve(nginx, "m4/model.bin", data)
    uri = nginx.url("m4/model.bin")
    partial = kserve_fill(tmp_path / "root", uri, data[: len(data) // 2])  # KServe's Job did not finish
    bad = "s3://bucket/a/../m"  # a URI modelcache refuses, KServe-filled and reported downloaded
    bad_folder = tmp_path / "root" / "models" / storage_key(bad)
    bad_folder.mkdir(parents=True)
    (bad_folder / "weights.bin").write_bytes(b"w" * 100)
    agent = make_agent(tmp_path)
    try:
        agent.set_spec([LocalModelInfo(model_name="partial", source_model_uri=uri),
                        LocalModelInfo(model_name="refused", source_model_uri=bad)],
                       reported={"partial": DL, "refused": D})
        first = agent.status()["modelStatus"]
        assert first["refused"] == D and first["partial"] != D
        agent.start()
        wait_until(lambda: agent.status()["modelStatus"]["partial"] == D, timeout=30, what="the completed folder")
        assert (partial / "model.bin").read_bytes() == data
        d = detail(agent, "refused")
        assert agent.status()["modelStatus"]["refused"] == D and d["verification"] == "Unverified"
        assert "InvalidURI" in d["message"], d
    finally:
        agent.stop()


def test_a_carried_folder_that_vanished_is_downloaded_like_any_missing_model(nginx: NginxServer,
                                                                             tmp_path: Path) -> None:
    data = os.urandom(1 << 20)
    serve(nginx, "m5/model.bin", data)
    uri = nginx.url("m5/model.bin")
    folder = kserve_fill(tmp_path / "root", uri, data)
    agent = make_agent(tmp_path)
    try:
        agent.set_spec([LocalModelInfo(model_name="m", source_model_uri=uri)], reported={"m": D})
        assert detail(agent, "m")["verification"] == "Verifying"
        (folder / "model.bin").unlink()  # removed by hand before the agent got to it
        agent.start()
        wait_until(lambda: NodeStore.at(tmp_path / "root").is_present(storage_key(uri)), timeout=30,
                   what="the downloaded model")
        assert "verification" not in detail(agent, "m") and (folder / "model.bin").read_bytes() == data
    finally:
        agent.stop()
