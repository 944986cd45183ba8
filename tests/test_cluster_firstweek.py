"""The lifecycle review's findings on the real control plane (issue 27): an etcd restore, as the
review ran it (finding 1, ``exp6_restore.py`` and ``exp10_restore_agent_gap.py``), the copies
gauges of a cache deleted without its finalizer (finding 4), and two caches of one URI in groups
with different storageLimits (finding 2, ``exp3_control.py G`` / ``exp2_churn.py C``).

After a restore every resourceVersion written since the backup is gone, and the versions clients
hold lie in the server's future. The coordinator used to miss, for good, every change written
between the restored revision and the one it had seen (a cache created right after the restore
got no finalizer, status or entry; a cache the restore removed stayed an entry, on disk and
labelled) once the cluster's ordinary writes carried the revision past its own; a running agent
kept its pre-restore spec for a minute or more."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from coordinator.nodelabels import LABEL_PREFIX
from modelcache.kube.client import (
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    LOCAL_MODEL_NODES,
    NODES,
    Kube,
    load_api_client,
)
from modelcache.sources.uri import storage_key
from tests.agent_util import AgentProc, start_agent
from tests.coordinator_util import GROUP_LABEL, make_cache, make_group
from tests.fixtures.cluster import Cluster
from tests.fixtures.http import NginxServer
from tests.helpers import REPO, free_port, stop_process, wait_until

pytestmark = pytest.mark.timeout(420)

D = "ModelDownloaded"
#: The review's coordinator: a long lease, so it lives through the API server's restarts.
LONG_LEASE = ("--lease-duration", "60", "--renew-deadline", "45", "--retry-period", "2")


class Coordinator:
    """The coordinator as its own process, as deploy/ runs it (leader election on)."""

    def __init__(self, cluster: Cluster, workdir: Path, *extra: str) -> None:
        self.cluster, self.workdir, self.extra = cluster, workdir, extra
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.log = self.workdir / f"coordinator-{time.monotonic_ns()}.log"
        env = {**os.environ, "KUBECONFIG": str(self.cluster.coordinator_kubeconfig), "POD_NAME": f"coord-{self.port}",
               "POD_NAMESPACE": "modelcache-system"}
        cmd = [sys.executable, "-m", "coordinator", "--bind", "127.0.0.1", "--port", str(self.port), *self.extra]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)

    def reap(self) -> None:
        """A replica that exited (a leader that could not renew its lease while the API server was
        down exits, by design) is replaced, as its Deployment would."""
        if self.proc.poll() is not None:
            self.restarts += 1
            self._start()

    def copies_gauges(self, cache: str) -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
        return [ln for ln in body.splitlines() if ln.startswith("modelcache_cache_copies") and f'"{cache}"' in ln]

    def stop(self) -> None:
        stop_process(self.proc)


class World:
    def __init__(self, cluster: Cluster, nginx: NginxServer, tmp_path: Path) -> None:
        self.cluster, self.kube, self.tmp = cluster, Kube(load_api_client(str(cluster.kubeconfig))), tmp_path
        self.uris: dict[str, str] = {}
        for n in "cdefg":
            nginx.write(f"fast/{n}.bin", 1 << 20, seed=ord(n))
            self.uris[n] = nginx.url(f"fast/{n}.bin")
        self.root = tmp_path / "root-n1"

    def entries(self) -> list[str]:
        lmn = self.kube.get_or_none(LOCAL_MODEL_NODES, "n1") or {}
        return [e["modelName"] for e in (lmn.get("spec") or {}).get("localModels") or []]

    def states(self) -> dict[str, str]:
        lmn = self.kube.get_or_none(LOCAL_MODEL_NODES, "n1") or {}
        return dict(((lmn.get("status") or {}).get("modelStatus")) or {})

    def disk(self) -> set[str]:
        models = self.root / "models"
        return {p.name for p in models.iterdir()} if models.is_dir() else set()

    def labels(self) -> set[str]:
        labels = self.kube.get(NODES, "n1")["metadata"].get("labels") or {}
        return {k.removeprefix(LABEL_PREFIX) for k in labels if k.startswith(LABEL_PREFIX)}

    def keys(self, *names: str) -> set[str]:
        return {storage_key(self.uris[n]) for n in names}

    def cache(self, name: str) -> dict[str, Any]:
        return self.kube.get_or_none(LOCAL_MODEL_CACHES, name) or {}

    def wait(self, what: str, cond: Any, timeout: float, agent: AgentProc, coord: Coordinator | None) -> None:
        def check() -> bool:
            if coord is not None:
                coord.reap()
            return bool(cond())

        try:
            wait_until(check, timeout=timeout, what=what)
        except TimeoutError as exc:
            raise AssertionError(
                f"{exc}: entries {self.entries()} states {self.states()} disk {sorted(self.disk())} labels "
                f"{sorted(self.labels())}\nagent log tail:\n{agent.log()[-3000:]}\ncoordinator log tail:\n"
                f"{coord.log.read_text()[-3000:] if coord else ''}") from None


def test_an_etcd_restore_is_followed_by_the_coordinator_and_the_agent(
        cluster_factory: Any, nginx: NginxServer, tmp_path: Path) -> None:
    """exp6: one node, one coordinator that lives through the restore. ``r1`` before the backup,
    ``bk`` after it; the restore; ``bk2`` created right after; the cluster then goes on writing
    (node annotation patches standing in for leases, Events and status writes) past the old
    revision; then ``late``. Part F first: the gauges of a cache deleted without its finalizer."""
    cluster = cluster_factory()
    w = World(cluster, nginx, tmp_path)
    kube = w.kube
    cluster.register_node("n1", {GROUP_LABEL: "gpu"})
    make_group(kube, "gpu", label_value="gpu")
    coord = Coordinator(cluster, tmp_path, *LONG_LEASE)
    agent = start_agent(cluster.agent_kubeconfig, "n1", w.root, tmp_path)
    try:
        # -- F: a cache whose finalizer is stripped before its delete (the usual fix for a stuck one).
        make_cache(kube, "fin", w.uris["g"], ["gpu"])
        w.wait("fin available", lambda: (w.cache("fin").get("status") or {}).get("copies", {}).get("available") == 1,
               90, agent, coord)
        assert any('state="available"} 1.0' in ln for ln in coord.copies_gauges("fin"))
        kube.patch(LOCAL_MODEL_CACHES, "fin", {"metadata": {"finalizers": None}})
        kube.delete(LOCAL_MODEL_CACHES, "fin")
        w.wait("fin's entry and files gone", lambda: "fin" not in w.entries() and not w.keys("g") & w.disk(), 60,
               agent, coord)
        wait_until(lambda: coord.copies_gauges("fin") == [], timeout=15, what="fin's copies gauges forgotten")

        # -- the restore.
        make_cache(kube, "r1", w.uris["c"], ["gpu"])
        w.wait("r1 downloaded", lambda: w.states().get("r1") == D, 90, agent, coord)
        backup = cluster.cp.backup_etcd()
        make_cache(kube, "bk", w.uris["d"], ["gpu"])
        w.wait("bk downloaded and labelled", lambda: w.states().get("bk") == D and w.keys("d") <= w.labels(), 90,
               agent, coord)
        before = cluster.cp.etcd_revision()
        cluster.cp.restore_etcd(backup)
        after = cluster.cp.etcd_revision()
        assert after < before, (before, after)
        assert [c["metadata"]["name"] for c in kube.list(LOCAL_MODEL_CACHES)["items"]] == ["r1"]
        assert coord.proc.poll() is None and coord.restarts == 0  # the coordinator lived through it
        make_cache(kube, "bk2", w.uris["e"], ["gpu"])
        for i in range(before - after + 50):  # the cluster goes on writing past the old revision
            kube.patch(NODES, "n1", {"metadata": {"annotations": {"activity": str(i)}}})
        assert cluster.cp.etcd_revision() > before
        make_cache(kube, "late", w.uris["f"], ["gpu"])

        want = {"r1", "bk2", "late"}
        w.wait("the restored state followed: bk2 and late downloaded, bk gone from entries, disk and labels",
               lambda: set(w.entries()) == want and w.disk() == w.keys("c", "e", "f")
               and w.labels() == w.keys("c", "e", "f") and {k: w.states().get(k) for k in want} == dict.fromkeys(
                   want, D), 120, agent, coord)
        w.wait("bk2 finalized and counted", lambda: bool(w.cache("bk2")["metadata"].get("finalizers"))
               and (w.cache("bk2").get("status") or {}).get("copies", {}).get("available") == 1, 30, agent, coord)
        assert "bk" not in w.states()
        assert "relisting" in coord.log.read_text()
    finally:
        agent.stop()
        coord.stop()


def test_a_running_agent_follows_a_restore_the_restarted_coordinator_writes_inside_the_gap(
        cluster_factory: Any, nginx: NginxServer, tmp_path: Path) -> None:
    """exp10: Kubernetes' advice after a restore (restart the controllers, leave the DaemonSet
    running), with 300 writes between the backup and the restore, so the fresh coordinator writes
    the node's new spec at a revision the agent's watch would filter out. The agent used to go on
    with its pre-restore spec for about a minute: ``bk`` kept and reported, ``bk2`` not fetched."""
    cluster = cluster_factory()
    w = World(cluster, nginx, tmp_path)
    kube = w.kube
    cluster.register_node("n1", {GROUP_LABEL: "gpu"})
    cluster.register_node("other", {GROUP_LABEL: "none"})
    make_group(kube, "gpu", label_value="gpu")
    coord: Coordinator | None = Coordinator(cluster, tmp_path)
    agent = start_agent(cluster.agent_kubeconfig, "n1", w.root, tmp_path)
    try:
        make_cache(kube, "r1", w.uris["c"], ["gpu"])
        w.wait("r1 downloaded", lambda: w.states().get("r1") == D, 90, agent, coord)
        backup = cluster.cp.backup_etcd()
        make_cache(kube, "bk", w.uris["d"], ["gpu"])
        w.wait("bk downloaded", lambda: w.states().get("bk") == D, 90, agent, coord)
        for i in range(300):  # the cluster's ordinary writes between the backup and the restore
            kube.patch(NODES, "other", {"metadata": {"annotations": {"activity": str(i)}}})
        before = cluster.cp.etcd_revision()
        assert coord is not None
        coord.stop()
        coord = None
        cluster.cp.restore_etcd(backup)
        assert cluster.cp.etcd_revision() < before - 250
        coord = Coordinator(cluster, tmp_path)  # a fresh coordinator lists the restored state
        make_cache(kube, "bk2", w.uris["e"], ["gpu"])
        t0 = time.monotonic()
        w.wait("the agent follows the restored spec: bk deleted and not reported, bk2 downloaded",
               lambda: set(w.states()) == {"r1", "bk2"} and set(w.states().values()) == {D}
               and w.disk() == w.keys("c", "e"), 60, agent, coord)
        # The review saw ~62 s; the agent's informer relists as soon as the API server answers.
        assert time.monotonic() - t0 < 60
        assert "relisting" in agent.log()
        wait_until(lambda: (w.cache("bk2").get("status") or {}).get("copies", {}).get("available") == 1, timeout=30,
                   what="bk2 counted by the fresh coordinator")
    finally:
        agent.stop()
        if coord is not None:
            coord.stop()


@pytest.mark.parametrize("first", ["small", "big"])
def test_two_caches_of_one_uri_in_groups_with_different_limits_are_each_judged_in_their_own(
        cluster: Cluster, nginx: NginxServer, tmp_path: Path, first: str) -> None:
    """exp3 G / exp2 C on the real control plane: node n3 is in groups ``big`` (100Mi) and
    ``small`` (3 MiB); cache p (a 4 MiB model) lists [small], cache q with the same URI [big]. The
    first entry's group used to decide for both: p first failed q in 'big' naming 'small'; q first
    reported p Downloaded past its group's limit."""
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    nginx.write("g/m.bin", 4 << 20)
    uri = nginx.url("g/m.bin")
    cluster.register_node("n3", {GROUP_LABEL: "both"})
    for name, limit in (("big", "100Mi"), ("small", "3Mi")):
        make_group(kube, name, label_value="both")
        kube.patch(LOCAL_MODEL_NODE_GROUPS, name, {"spec": {"storageLimit": limit}})
    coord = Coordinator(cluster, tmp_path)
    agent = start_agent(cluster.agent_kubeconfig, "n3", tmp_path / "root", tmp_path)
    try:
        order = [("p", "small"), ("q", "big")] if first == "small" else [("q", "big"), ("p", "small")]
        for name, group in order:
            make_cache(kube, name, uri, [group], modelSize="4Mi")

        def status(name: str) -> dict[str, Any]:
            return (kube.get_or_none(LOCAL_MODEL_CACHES, name) or {}).get("status") or {}

        def settled() -> bool:
            lmn = (kube.get_or_none(LOCAL_MODEL_NODES, "n3") or {}).get("status") or {}
            return lmn.get("modelStatus") == {"p": "ModelDownloadError", "q": D} and \
                status("q").get("copies", {}).get("available") == 1 and status("p").get("copies", {}).get("failed") == 1

        try:
            wait_until(settled, timeout=90, what="q downloaded in 'big', p refused in 'small'")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}: {kube.get_or_none(LOCAL_MODEL_NODES, 'n3')}\n{agent.log()[-3000:]}") from None
        message = kube.get(LOCAL_MODEL_NODES, "n3")["status"]["modelDetails"]["p"]["message"]
        assert "LocalModelNodeGroup 'small' has storageLimit 3.0 MiB" in message and "'big'" not in message, message
        assert "raise spec.storageLimit of LocalModelNodeGroup 'small'" in message
    finally:
        agent.stop()
        coord.stop()


def test_a_failing_node_is_explained_on_the_cache_naming_the_secret_and_service_account(
        cluster: Cluster, moto_s3: Any, tmp_path: Path) -> None:
    """C10: a cache whose keys (Secret modelcache-credentials/bad-s3 via ServiceAccount badsa)
    S3 refuses. The message named AWS_* variables and "the storage-spec secret"; `kubectl
    describe localmodelcache` showed only NodeDownloadError per node, with no reason and no event."""
    from tests.agent_util import CRED_NS, create_secret, create_service_account

    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    bucket = moto_s3.new_bucket()
    moto_s3.client().put_object(Bucket=bucket, Key="small/w.bin", Body=b"w" * 1000)
    host = moto_s3.endpoint.removeprefix("http://")
    create_secret(kube, "bad-s3", {"awsAccessKeyID": "AKIAWRONGWRONGWRONG1", "awsSecretAccessKey": "wrong"},
                  annotations={"serving.kserve.io/s3-endpoint": host, "serving.kserve.io/s3-usehttps": "0",
                               "serving.kserve.io/s3-region": "us-east-1"})
    create_service_account(kube, "badsa", ["bad-s3"])
    cluster.register_node("n1", {GROUP_LABEL: "gpu"})
    make_group(kube, "gpu", label_value="gpu")
    coord = Coordinator(cluster, tmp_path)
    agent = start_agent(cluster.agent_kubeconfig, "n1", tmp_path / "root", tmp_path)
    try:
        make_cache(kube, "small", f"s3://{bucket}/small", ["gpu"], serviceAccountName="badsa")

        def condition() -> dict[str, Any] | None:
            conds = ((kube.get_or_none(LOCAL_MODEL_CACHES, "small") or {}).get("status") or {}).get("conditions") or []
            return next((c for c in conds if c["type"] == "NoDownloadErrors"), None)

        wait_until(lambda: (condition() or {}).get("status") == "False", timeout=90, what="the failure on the cache")
        cond = condition()
        assert cond is not None and cond["reason"] == "NodeDownloadError"
        want = (f"node n1: Unauthorized: S3 rejected the credentials for s3://{bucket}/small (InvalidAccessKeyId): "
                f"check Secret {CRED_NS}/bad-s3 of ServiceAccount {CRED_NS}/badsa and the region")
        assert cond["message"] == want, cond["message"]
        assert "AWS_ACCESS_KEY_ID" not in cond["message"] and "(retry" not in cond["message"]
        described = cluster.kubectl("describe", "localmodelcache", "small").stdout
        assert "NoDownloadErrors" in described and "InvalidAccessKeyId" in described
        events = cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=small", "-o",
                                 "jsonpath={range .items[*]}{.reason}: {.message}{'\\n'}{end}").stdout
        assert f"DownloadFailed: {want}" in events.splitlines(), events
    finally:
        agent.stop()
        coord.stop()
    # The coordinator logs as the agent does (logfmt, RFC 3339 times), not in Python's default
    # format; a line about a bound address names the address it is bound to.
    lines = [ln for ln in coord.log.read_text().splitlines() if ln.strip()]
    assert lines and all(ln.startswith("ts=20") and " level=" in ln for ln in lines), lines[:5]
    assert not any(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", ln) for ln in lines)
    serving = [ln for ln in lines if "webhooks serving on" in ln]
    assert all("webhooks serving on 127.0.0.1:" in ln for ln in serving), serving


def test_a_second_cache_of_the_same_source_spelled_differently_is_warned_about(
        cluster: Cluster, coordinator_factory: Any) -> None:
    """C16: the cluster accepted a LocalModelCache for `s3://models/llm/` beside `s3://models/llm`
    without a word (the CLI prints a note in the same case). Allowed, as KServe allows it, with a
    warning that kubectl prints."""
    from tests.coordinator_util import register_webhooks

    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    make_group(kube, "gpu", label_value="gpu")
    coord = coordinator_factory(cluster)
    register_webhooks(cluster, coord)

    def cache(name: str, uri: str) -> Any:
        body = (f"apiVersion: serving.kserve.io/v1alpha1\nkind: LocalModelCache\nmetadata: {{name: {name}}}\n"
                f"spec: {{sourceModelUri: '{uri}', modelSize: 1Gi, nodeGroups: [gpu]}}\n")
        return cluster.kubectl("create", "-f", "-", input=body)

    first = cache("llm", "s3://models/llm")
    assert "Warning" not in first.stderr, first.stderr
    second = cache("llm-slash", "s3://models/llm/")
    assert second.returncode == 0
    assert ("Warning: LocalModelCache llm caches the same source spelled s3://models/llm: KServe keys a model by the "
            "URI's exact text, so s3://models/llm/ is downloaded and stored again on every node; use one spelling to "
            "keep one copy") in second.stderr, second.stderr
    other = cache("other", "s3://models/other")
    assert "Warning" not in other.stderr


def test_webhooks_register_after_deploy_was_applied_client_side_as_install_md_says(
        cluster_factory: Any, coordinator_factory: Any) -> None:
    """The newcomer review, "Docs against reality": after a plain client-side `kubectl apply -k
    deploy/` (install.md's step 3), pointing the webhooks at a coordinator running as a process
    (what demo.py and the tests do, there being no kube-proxy) failed with `exactly one of url or
    service is required`: the server-side apply merged its `url` with the `service` another field
    manager had applied."""
    from tests.coordinator_util import register_webhooks

    cluster = cluster_factory(baseline=False)
    cluster.kubectl("apply", "-k", str(REPO / "deploy"))
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        hooks = cluster.kubectl("get", kind, "-o", "jsonpath={.items[*].webhooks[*].clientConfig.service.name}").stdout
        assert "modelcache-coordinator-webhook" in hooks, hooks  # as shipped: a Service
    coord = coordinator_factory(cluster)
    register_webhooks(cluster, coord)
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        for doc in json.loads(cluster.kubectl("get", kind, "-o", "json").stdout)["items"]:
            if not doc["metadata"]["name"].startswith("modelcache"):
                continue
            for hook in doc["webhooks"]:
                assert set(hook["clientConfig"]) == {"url", "caBundle"}, hook["clientConfig"]
                assert hook["clientConfig"]["url"].startswith(f"https://127.0.0.1:{coord.cfg.webhook_port}/")
    # The API server calls the coordinator: its warning on a second spelling of one source.
    make_group(Kube(load_api_client(str(cluster.kubeconfig))), "gpu", label_value="gpu")
    for name, uri in (("llm", "s3://models/llm"), ("llm-slash", "s3://models/llm/")):
        body = (f"apiVersion: serving.kserve.io/v1alpha1\nkind: LocalModelCache\nmetadata: {{name: {name}}}\n"
                f"spec: {{sourceModelUri: '{uri}', modelSize: 1Gi, nodeGroups: [gpu]}}\n")
        proc = cluster.kubectl("create", "-f", "-", input=body)
    assert "Warning: LocalModelCache llm caches the same source spelled s3://models/llm" in proc.stderr, proc.stderr
