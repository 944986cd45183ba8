"""``modelcache-coordinator``: caches to nodes, truthful status, services, PV/PVCs, pod placement."""

from __future__ import annotations

import datetime as dt
import signal
import socket
import sys
from pathlib import Path

import click

from coordinator.app import Config, Coordinator
from modelcache.kube.client import in_cluster_namespace
from modelcache.runtime.logs import setup_logging
from modelcache.runtime.startup import env_for_every_flag, run_command


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None,
              help="kubeconfig file; default: in-cluster, else $KUBECONFIG / ~/.kube/config")
@click.option("--webhook-cert-secret", default=None,
              help="keep our own CA and serving pair in this Secret (in --lease-namespace), patch the CA into "
                   "the webhook configurations, renew before expiry; the webhooks serve it")
@click.option("--webhook-service", default="modelcache-coordinator-webhook",
              help="the webhooks' Service: the serving certificate names <service>.<namespace>.svc")
@click.option("--webhook-cert-host", "webhook_cert_hosts", multiple=True,
              help="another DNS name or IP for the serving certificate (webhooks reached by URL); repeatable")
@click.option("--webhook-cert-validity", type=float, default=365 * 86400.0,
              help="seconds a serving certificate is valid (renewed when a third is left)")
@click.option("--webhook-ca-validity", type=float, default=10 * 365 * 86400.0,
              help="seconds the webhook CA is valid (renewed when a third is left)")
@click.option("--webhook-cert-check", type=float, default=3600.0, help="seconds between expiry checks")
@click.option("--webhook-cert-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="directory with tls.crt and tls.key (cert-manager's Secret volume); with --webhook-cert-secret: "
                   "where the pair is written (default: a private temporary directory)")
@click.option("--webhook-port", type=click.IntRange(0, 65535), default=9443)
@click.option("--webhook-client-ca", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="mutual TLS: the CA (PEM) of the API server's client certificate for webhooks "
                   "(kube-apiserver --admission-control-config-file); callers without one are refused")
@click.option("--webhook-client-name", "webhook_client_names", multiple=True,
              help="with --webhook-client-ca: the common or DNS name the client certificate must carry; repeatable")
@click.option("--self-signed/--no-self-signed", default=False,
              help="generate a self-signed pair into --webhook-cert-dir if none is there (development)")
@click.option("--bind", "host", default="::",
              help="address of the health/metrics and webhook servers (:: = every IPv4 and IPv6 address)")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, help="port of /healthz, /readyz and /metrics")
@click.option("--leader-election/--no-leader-election", default=True)
@click.option("--lease-name", default="modelcache-coordinator")
@click.option("--lease-namespace", envvar="POD_NAMESPACE",
              default=lambda: in_cluster_namespace() or "modelcache-system",
              show_default="the pod's namespace, else modelcache-system")
@click.option("--identity", envvar="POD_NAME", default=socket.gethostname(), help="lease holder identity")
@click.option("--lease-duration", type=click.FloatRange(min=0, min_open=True), default=15.0,
              help="seconds a standby waits before taking over a lease that is not renewed")
@click.option("--renew-deadline", type=click.FloatRange(min=0, min_open=True), default=10.0,
              help="seconds the leader keeps acting without a successful renewal (then it stops and exits)")
@click.option("--retry-period", type=click.FloatRange(min=0, min_open=True), default=2.0,
              help="seconds between lease renewals and attempts")
@click.option("--mutate-isvc/--no-mutate-isvc", default=False,
              help="also keep services' local-model label/annotations right continuously, after admission: a cache "
                   "created or deleted then rolls out the running services that match it (KServe never does that; "
                   "the /mutate-services webhook sets them at admission, as KServe's defaulter does)")
@click.option("--pod-rewrite", type=click.Choice(["off", "on"]), default="off",
              help="also do KServe's local-model pod rewrite (where KServe's pod mutator is not installed)")
@click.option("--pod-failure-policy", type=click.Choice(["Ignore", "Fail"]), default="Ignore",
              help="when the pod webhook cannot look up caches: admit unchanged, or deny")
@click.option("--workers", type=click.IntRange(1, 64), default=2, help="workers per controller")
@click.option("--discovery-interval", type=click.FloatRange(min=0), default=30.0,
              help="InferenceService/LLMInferenceService CRDs installed later are watched by name; where that "
                   "is not allowed, seconds between checks for them (0: no discovery after start)")
@click.option("--missing-group-grace", type=click.FloatRange(min=0), default=None,
              help="seconds a deleted node group's nodes keep its models (default: until the group "
                   "returns or the cache stops listing it, as KServe)")
@click.option("--deleted-node-grace", type=click.FloatRange(min=0), default=15.0, show_default=True,
              help="seconds a deleted Node keeps its LocalModelNode (and so its models' entries) in case it "
                   "registers again; then the LocalModelNode is deleted (KServe never deletes it)")
@click.option("--log-level", default="INFO",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--log-format", type=click.Choice(["logfmt", "json"]), default="logfmt", show_default=True,
              help="logfmt lines, or one JSON object per line (as the agent's)")
def cli(kubeconfig: str | None, webhook_cert_secret: str | None, webhook_service: str,
         webhook_cert_hosts: tuple[str, ...], webhook_cert_validity: float, webhook_ca_validity: float,
         webhook_cert_check: float, webhook_cert_dir: Path | None, webhook_port: int, webhook_client_ca: Path | None,
         webhook_client_names: tuple[str, ...], self_signed: bool,
         host: str, port: int, leader_election: bool, lease_name: str, lease_namespace: str, identity: str,
         lease_duration: float, renew_deadline: float, retry_period: float, mutate_isvc: bool,
         pod_rewrite: str, pod_failure_policy: str, workers: int, discovery_interval: float,
         missing_group_grace: float | None, deleted_node_grace: float, log_level: str, log_format: str) -> None:
    """Run the modelcache coordinator."""
    setup_logging(log_format, log_level)  # the agent's format: one for every long-running process
    cfg = Config(
        kubeconfig=kubeconfig, webhook_cert_dir=webhook_cert_dir, webhook_cert_secret=webhook_cert_secret,
        webhook_service=webhook_service, webhook_cert_hosts=webhook_cert_hosts, webhook_host=host,
        webhook_cert_validity=dt.timedelta(seconds=webhook_cert_validity),
        webhook_ca_validity=dt.timedelta(seconds=webhook_ca_validity), webhook_cert_check=webhook_cert_check,
        webhook_port=webhook_port, webhook_client_ca=webhook_client_ca, webhook_client_names=webhook_client_names,
        self_signed=self_signed, host=host, port=port, leader_election=leader_election, lease_name=lease_name,
        lease_namespace=lease_namespace, identity=identity, mutate_isvc=mutate_isvc, pod_rewrite=pod_rewrite == "on",
        pod_fail_closed=pod_failure_policy == "Fail", workers=workers, discovery_interval=discovery_interval,
        missing_group_grace=missing_group_grace, deleted_node_grace=deleted_node_grace,
        lease_duration=lease_duration, renew_deadline=renew_deadline,
        retry_period=retry_period,
    )
    coordinator = Coordinator(cfg)  # a KubeConfigError is a StartupError: one line, exit 2

    def on_signal(_sig: int, _frame: object) -> None:
        coordinator.done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        coordinator.start()
    except BaseException:
        coordinator.stop()  # a server already started must not keep the process alive
        raise
    code = coordinator.wait()
    coordinator.stop()
    sys.exit(code)


env_for_every_flag(cli, "MODELCACHE_COORDINATOR_")


def main() -> None:
    run_command(cli, "modelcache-coordinator")


if __name__ == "__main__":
    main()
