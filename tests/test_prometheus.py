"""A real Prometheus (Debian's package) scraping two agents and the leading coordinator on the real
control plane while they download: one node's cache downloads (throttled, so scrapes land during
the download), the other node also has a cache whose source answers 404, and the alert for failing
downloads fires through Prometheus for that node only, with the rule file users deploy. The same
run checks the scraped /metrics with `promtool check metrics`, runs every dashboard query against
this Prometheus, and shows the fleet with `modelcache status` (text and -o json)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelcache.kube.client import LOCAL_MODEL_CACHES, Kube, load_api_client
from tests.agent_util import AgentProc, start_agent
from tests.coordinator_util import make_cache, make_group, make_namespace, make_node
from tests.fixtures.cluster import Cluster
from tests.helpers import REPO, free_port, start_logged, stop_process, wait_until
from tests.test_dashboard import dashboard, queries

pytestmark = pytest.mark.timeout(600)

RULES = REPO / "monitoring" / "alerts.yaml"
SIZE = 48 << 20
RATE = 4 << 20  # bytes/s per connection: ~12 s of download, four scrapes or more
#: Scrapes every 3 s, each allowed 3 s: a loaded 2-core machine can take over a second to answer one
#: (a failed scrape makes every series of the target stale, and an alert on them resolves).
SCRAPE = "3s"


class Prometheus:
    def __init__(self, binary: str, workdir: Path, agents: dict[str, int], coordinator: int) -> None:
        self.port = free_port()
        config = {
            "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                # Job names as the PodMonitors of deploy/components/monitoring make them.
                {"job_name": "modelcache-system/modelcache-agent", "static_configs": [
                    {"targets": [f"127.0.0.1:{port}"], "labels": {"node": node}} for node, port in agents.items()]},
                {"job_name": "modelcache-system/modelcache-coordinator",
                 "static_configs": [{"targets": [f"127.0.0.1:{coordinator}"]}]},
            ],
        }
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        self.proc = start_logged([binary, f"--config.file={workdir / 'prometheus.yml'}",
                                  f"--storage.tsdb.path={workdir / 'data'}", "--storage.tsdb.retention.time=1h",
                                  f"--web.listen-address=127.0.0.1:{self.port}"], self.log)
        wait_until(self._ready, timeout=60, what="prometheus /-/ready")

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as resp:
            return json.loads(resp.read()) if path.startswith("/api") else resp.status

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.log.read_text()[-3000:]}")
        try:
            return bool(self._get("/-/ready") == 200)
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]  # type: ignore[no-any-return]

    def alerts(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/alerts")["data"]["alerts"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def prometheus_factory(tmp_path: Path, prometheus_bin: str) -> Iterator[Any]:
    started: list[Prometheus] = []

    def make(agents: dict[str, int], coordinator: int) -> Prometheus:
        p = Prometheus(prometheus_bin, tmp_path / "prometheus", agents, coordinator)
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


def check_metrics(promtool: str, body: str, what: str) -> None:
    proc = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), \
        f"promtool check metrics on the {what}'s /metrics: {proc.stdout}{proc.stderr}"


def test_prometheus_fires_the_failing_download_alert_through_real_scrapes(
    cluster: Cluster, nginx: Any, coordinator_factory: Any, prometheus_factory: Any, promtool: str, tmp_path: Path,
) -> None:
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    nginx.write("slow/model.bin", SIZE)
    nginx.set_limit_rate("slow", RATE)
    good, bad = nginx.url("slow/model.bin"), nginx.url("gone/model.bin")  # the second answers 404
    make_namespace(kube, "modelcache-system")
    make_node(kube, "node-1", **{"kserve/localmodel": "worker"})
    make_node(kube, "node-2", **{"kserve/localmodel": "broken"})
    make_group(kube, "workers", label_value="worker")
    make_group(kube, "broken", label_value="broken")
    agents: dict[str, AgentProc] = {
        n: start_agent(cluster.agent_kubeconfig, n, tmp_path / f"root-{n}", tmp_path / "agents", name=n)
        for n in ("node-1", "node-2")}
    coord = coordinator_factory(cluster, wait=False, leader_election=True, lease_duration=4.0, renew_deadline=3.0,
                                retry_period=0.5)
    prom = None
    try:
        wait_until(coord.controllers_running.is_set, timeout=60, what="leader's controllers")
        for n, a in agents.items():  # a loaded machine takes a while to import an agent
            wait_until(lambda a=a: "serving health and metrics" in a.log() or a.proc.poll() is not None,
                       timeout=180, what=f"the agent of {n} serving /metrics")
            assert a.proc.poll() is None, a.log()[-3000:]
        prom = prometheus_factory({n: a.port for n, a in agents.items()}, coord.cfg.port)
        wait_until(lambda: len([r for r in prom.query("up") if r["value"][1] == "1"]) == 3, timeout=60,
                   what="prometheus scrapes both agents and the coordinator")
        make_cache(kube, "good", good, ["workers", "broken"])
        make_cache(kube, "bad", bad, ["broken"])

        # Scraped during the download: the throttled model was in flight on node-1 in some scrape.
        wait_until(lambda: prom.query('max_over_time(modelcache_agent_models{node="node-1",'
                                      'state="ModelDownloading"}[5m]) >= 1'), timeout=60,
                   what="a scrape of node-1 while its model downloads")

        def firing() -> list[dict[str, Any]]:
            return [a for a in prom.alerts() if a["labels"]["alertname"] == "ModelcacheDownloadsFailing"
                    and a["state"] == "firing"]

        try:
            wait_until(lambda: bool(firing()), timeout=120, what="ModelcacheDownloadsFailing firing")
        except TimeoutError:
            raise AssertionError(f"alerts: {prom.alerts()}\nnode-2 errors: "
                                 f"{prom.query('modelcache_agent_download_duration_seconds_count')}\n"
                                 f"{agents['node-2'].log()[-3000:]}") from None
        (alert,) = firing()
        assert alert["labels"]["node"] == "node-2" and alert["labels"]["severity"] == "warning"
        assert alert["labels"]["job"] == "modelcache-system/modelcache-agent"
        assert "kubectl describe localmodelnode node-2" in alert["annotations"]["description"]

        # The good cache reaches both nodes, through the coordinator's gauge as Prometheus sees it.
        wait_until(lambda: prom.query('modelcache_cache_copies{cache="good",state="available"} == 2'), timeout=90,
                   what="good: 2 copies available in prometheus")
        assert kube.get(LOCAL_MODEL_CACHES, "good")["status"]["copies"]["available"] == 2
        # The bad cache is below its copies: pending (for: 30m), the good one no longer.
        wait_until(lambda: any(a["labels"]["alertname"] == "ModelcacheCacheBelowWantedCopies"
                               and a["labels"]["cache"] == "bad" for a in prom.alerts()), timeout=30,
                   what="bad below its copies (pending)")

        def alert_states() -> dict[tuple[str, str], str]:
            # The API server is shared with other tests: their caches (no agents serve them) are below
            # their copies too. Every other alert counts, whatever it names.
            return {(a["labels"]["alertname"], a["labels"].get("cache", a["labels"].get("node", ""))): a["state"]
                    for a in prom.alerts()
                    if a["labels"].get("cache", "good") in ("good", "bad")}

        # good was below its copies while it downloaded (pending); it leaves at the next evaluation.
        wait_until(lambda: ("ModelcacheCacheBelowWantedCopies", "good") not in alert_states(), timeout=30,
                   what="good no longer below its copies")
        # Nothing else is wrong, so nothing else speaks (drift, disk, peers, certificate, liveness).
        expected = {("ModelcacheDownloadsFailing", "node-2"): "firing",
                    ("ModelcacheCacheBelowWantedCopies", "bad"): "pending"}
        total, _used, free = shutil.disk_usage(tmp_path)
        nearly_full = free / total < 0.10  # this machine's own disk: that alert is then right to pend

        def as_expected() -> bool:
            states = {k: v for k, v in alert_states().items()
                      if not (nearly_full and k[0] == "ModelcacheNodeRootNearlyFull")}
            return states == expected

        try:
            wait_until(as_expected, timeout=60, what="exactly the expected alerts")
        except TimeoutError:
            raise AssertionError(f"alerts: {alert_states()}; up: {prom.query('up')}") from None
        assert prom.query("modelcache_coordinator_webhook_cert_expiry_timestamp_seconds - time() > 86400")
        assert prom.query('modelcache_agent_storage_limit_bytes{node="node-2",node_group="broken"} == 10 * 1024^3')

        # The scraped pages are clean for promtool, and every dashboard query runs here.
        for node, agent in agents.items():
            check_metrics(promtool, agent.get("/metrics")[1], f"agent on {node}")
        with urllib.request.urlopen(f"http://127.0.0.1:{coord.cfg.port}/metrics", timeout=10) as resp:
            check_metrics(promtool, resp.read().decode(), "coordinator")
        empty = []
        for title, expr in queries(dashboard()):
            expr = expr.replace("$__rate_interval", "5m").replace("$node", ".*")
            if not prom.query(expr):
                empty.append(title)
        # Empty here for want of events, not of metrics: no peer transfer (these agents have no
        # peer token), no admission request (no webhook configuration points at this coordinator).
        assert set(empty) <= {"Peers", "Origin vs peer bytes", "Webhook requests by result"}, empty

        # The fleet at a glance, as a person runs it.
        env_cmd = [sys.executable, "-m", "modelcache", "status", "--kubeconfig", str(cluster.kubeconfig)]
        text = subprocess.run(env_cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert text.returncode == 0, text.stderr
        out = text.stdout
        assert re.search(r"^good +2/2 +broken 1/1, workers 1/1 ", out, re.M), out
        assert re.search(r"^bad +0/1 \(1 failed\) +broken 0/1 ", out, re.M), out
        assert re.search(r"^node-2 +broken +\S+ \S+ of \S+ \S+ +1/2 downloaded", out, re.M), out
        assert re.search(r"^node-2  bad  .*404", out, re.M), out
        as_json = subprocess.run([*env_cmd, "-o", "json"], capture_output=True, text=True, timeout=60, cwd=REPO)
        data = json.loads(as_json.stdout)
        assert {c["key"]: c["available"] for c in data["caches"]} == {"bad": 0, "good": 2}
        assert [(f["node"], f["model"]) for f in data["failures"]] == [("node-2", "bad")]
    finally:
        if prom is not None:
            prom.stop()
        for a in agents.values():
            a.stop()
