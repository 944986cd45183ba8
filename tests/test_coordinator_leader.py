"""Coordinator replicas: only the Lease holder reconciles, every replica serves webhooks, and a
successor takes over when the leader goes; the CLI runs the same thing as a process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import requests

from modelcache.kube.client import LEASES, LOCAL_MODEL_CACHES, Kube, load_api_client
from tests.coordinator_util import entries_of, make_cache, make_group, make_namespace, make_node
from tests.fixtures.cluster import Cluster
from tests.helpers import REPO, free_port, stop_process, wait_until

URI = "http://models.example/m.bin"


def holder(kube: Kube) -> str | None:
    lease = kube.get_or_none(LEASES, "modelcache-coordinator", "modelcache-system")
    return None if lease is None else (lease.get("spec") or {}).get("holderIdentity")


def test_only_the_leader_reconciles_and_a_successor_takes_over(cluster: Cluster, coordinator_factory: Any) -> None:
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    make_namespace(kube, "modelcache-system")
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    timing = {"leader_election": True, "lease_duration": 3.0, "renew_deadline": 2.0, "retry_period": 0.3}
    a = coordinator_factory(cluster, wait=False, **timing)
    wait_until(a.controllers_running.is_set, timeout=30, what="first replica leads")
    b = coordinator_factory(cluster, wait=False, **timing)
    wait_until(lambda: b.view is not None and b.view.synced(), timeout=30, what="standby caches warm")
    assert holder(kube) == a.cfg.identity and not b.leading.is_set() and not b.controllers_running.is_set()
    # The standby is ready too (it serves webhooks) and answers admission requests.
    assert requests.get(f"http://127.0.0.1:{b.cfg.port}/readyz", timeout=5).status_code == 200
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u1", "operation": "CREATE", "object": {"metadata": {"name": "x"}, "spec": {
                "sourceModelUri": URI, "modelSize": "1Gi", "nodeGroups": ["missing"]}}}}
    resp = requests.post(f"https://127.0.0.1:{b.cfg.webhook_port}/validate-localmodelcaches", json=body,
                         verify=str(b.cfg.webhook_cert_dir / "tls.crt"), timeout=5).json()
    assert resp["response"]["allowed"] is False

    make_cache(kube, "c1", URI, ["workers"])
    wait_until(lambda: entries_of(kube, "n1") == [{"modelName": "c1", "sourceModelUri": URI, "nodeGroup": "workers"}],
               timeout=30, what="leader reconciled c1")

    a.stop()  # releases the Lease: the standby takes over without waiting for it to expire
    wait_until(b.controllers_running.is_set, timeout=30, what="standby leads")
    assert holder(kube) == b.cfg.identity
    make_cache(kube, "c2", URI + "2", ["workers"])
    wait_until(lambda: len(entries_of(kube, "n1") or []) == 2, timeout=30, what="successor reconciles c2")


def test_cli_process(cluster: Cluster, tmp_path: Any) -> None:
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    make_namespace(kube, "modelcache-system")
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    port, hook_port = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(cluster.coordinator_kubeconfig), "POD_NAME": "coord-0",
           "POD_NAMESPACE": "modelcache-system"}
    cmd = [sys.executable, "-m", "coordinator", "--bind", "127.0.0.1", "--port", str(port),
           "--webhook-port", str(hook_port), "--webhook-cert-dir", str(tmp_path / "certs"), "--self-signed"]
    log = tmp_path / "coordinator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        def ready() -> bool:
            return requests.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200

        wait_until(ready, timeout=30, what=f"coordinator process ready ({log.read_text()[-1000:]})")
        make_cache(kube, "c", URI, ["workers"])
        wait_until(lambda: (kube.get(LOCAL_MODEL_CACHES, "c").get("status") or {}).get("copies", {}).get("total")
                   == 1, timeout=20, what="status written by the process")
        assert holder(kube) == "coord-0"
        assert (tmp_path / "certs" / "tls.crt").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert holder(kube) in (None, "")  # released on a clean exit
    finally:
        stop_process(proc)


def test_a_leader_that_loses_the_lease_stops(cluster: Cluster, coordinator_factory: Any) -> None:
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    make_namespace(kube, "modelcache-system")
    c = coordinator_factory(cluster, wait=False, leader_election=True, lease_duration=3.0, renew_deadline=2.0,
                            retry_period=0.3)
    wait_until(c.controllers_running.is_set, timeout=30, what="leading")
    # Another replica took the lease over (as after a partition): ours can no longer renew.
    lease = kube.get(LEASES, "modelcache-coordinator", "modelcache-system")
    lease["spec"].update(holderIdentity="someone-else", leaseDurationSeconds=3600)
    kube.replace(LEASES, lease, "modelcache-system")
    wait_until(c.done.is_set, timeout=30, what="deposed leader stops")
    assert c.exit_code == 1 and not c.leading.is_set()
