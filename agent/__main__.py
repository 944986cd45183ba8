"""``modelcache-agent``: flags (each with an environment default) -> AgentConfig -> a runner."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from agent.config import DEFAULT_ROOT, AgentConfig
from agent.logs import fields, setup_logging
from modelcache.engine.resources import check_buffers, chunk_size_problem
from modelcache.errors import ModelcacheError
from modelcache.runtime.health import HealthServer
from modelcache.runtime.progress import human_bytes
from modelcache.runtime.sizes import parse_size
from modelcache.runtime.startup import StartupError, check_writable_dir, env_for_every_flag, listen_error, run_command

if TYPE_CHECKING:
    from agent.metrics import AgentMetrics
    from agent.peering import Peering
    from modelcache.kube.client import Kube
    from modelcache.store import NodeStore

log = logging.getLogger("agent")


_POSITIVE = click.FloatRange(min=0, min_open=True)
_NON_NEGATIVE = click.FloatRange(min=0)


def _size(_ctx: click.Context, _param: click.Parameter, value: str) -> int:
    """Binary, as every modelcache command reads sizes (16M = 16Mi = 16MiB); modelcache/runtime/sizes.py."""
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _chunk_size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    n = _size(ctx, param, value)
    problem = chunk_size_problem(n)
    if problem:
        raise click.BadParameter(problem)
    return n


def _pod_namespace(fallback: str) -> str:
    from modelcache.kube.client import in_cluster_namespace  # lazily: --standalone needs no kubernetes

    return in_cluster_namespace() or fallback


def _env_pairs(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        for pair in item.split():
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise click.BadParameter(f"expected KEY=VALUE, got {key!r}")
            out[key] = value
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--node", envvar="NODE_NAME", help="This node's name: the LocalModelNode to serve.")
@click.option("--root", envvar="MODELCACHE_ROOT", default=DEFAULT_ROOT, show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Model root.")
@click.option("--max-concurrent-models", envvar="MODELCACHE_MAX_CONCURRENT_MODELS", default=2, show_default=True,
              type=click.IntRange(1), help="Models downloading at once.")
@click.option("--workers", envvar="MODELCACHE_WORKERS", default=8, show_default=True, type=click.IntRange(1),
              help="Parallel transfer workers per model.")
@click.option("--chunk-size", envvar="MODELCACHE_CHUNK_SIZE", default="8Mi", show_default=True, callback=_chunk_size,
              help="Ranged-read chunk size (64Ki to 1Gi).")
@click.option("--transfer-attempts", envvar="MODELCACHE_TRANSFER_ATTEMPTS", default=6, show_default=True,
              type=click.IntRange(1), help="Attempts per chunk within one download.")
@click.option("--stall-timeout", envvar="MODELCACHE_STALL_TIMEOUT", default=30.0, show_default=True,
              type=click.FloatRange(0.5, 3600), help="Seconds a stream may deliver nothing before it is cut and "
              "retried; a piece waits for peers at most half of it.")
@click.option("--resync-period", envvar="MODELCACHE_RESYNC_PERIOD", default=60.0, show_default=True, type=_POSITIVE,
              help="Seconds between full re-applications of the spec.")
@click.option("--port", envvar="MODELCACHE_AGENT_PORT", default=8080, show_default=True, type=click.IntRange(-1, 65535),
              help="Port for /healthz, /readyz and /metrics (0: any free port; -1: none). Standalone: 0.")
@click.option("--host", envvar="MODELCACHE_AGENT_HOST", default="::", show_default=True,
              help="Address of the health server; :: is every IPv4 and IPv6 address (dual-stack). Standalone: "
                   "127.0.0.1.")
@click.option("--credentials-namespace", envvar=["MODELCACHE_CREDENTIALS_NAMESPACE", "POD_NAMESPACE"],
              default=lambda: _pod_namespace("kserve"), show_default="the pod's namespace, else kserve",
              help="Where download credentials are looked up (docs/install.md#credentials).")
@click.option("--job-namespace", envvar="MODELCACHE_JOB_NAMESPACE", default="modelcache-jobs", show_default=True,
              help="Where download Jobs of KServe's localModelDownloadJob ClusterStorageContainers run (URIs none "
                   "of our sources reads; KServe's jobNamespace).")
@click.option("--kserve-config", envvar="MODELCACHE_KSERVE_CONFIG", default="kserve/inferenceservice-config",
              show_default=True, help="KServe's ConfigMap (NAMESPACE/NAME): its 'credentials' block (S3 defaults, "
                                      "key names, storage-spec secret name) applies as in KServe; absent: none.")
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None,
              help="Kubeconfig file (default: in-cluster, else ~/.kube/config).")
@click.option("--standalone", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="No cluster: read a LocalModelNode from this YAML file, write FILE.status.yaml beside it.")
@click.option("--watch", is_flag=True, help="Standalone: keep running (re-read FILE on change, retry errors).")
@click.option("--take-root", is_flag=True,
              help="Standalone: the first time the agent runs on a root that holds models it did not download "
                   "(pulled with `modelcache pull`), delete those FILE does not list instead of refusing to start.")
@click.option("--backoff-initial", envvar="MODELCACHE_BACKOFF_INITIAL", default=5.0, show_default=True, type=_POSITIVE,
              help="First retry delay of a failed model (doubles per failure).")
@click.option("--backoff-max", envvar="MODELCACHE_BACKOFF_MAX", default=300.0, show_default=True, type=_POSITIVE,
              help="Longest retry delay.")
@click.option("--status-interval", envvar="MODELCACHE_STATUS_INTERVAL", default=3.0, show_default=True, type=_POSITIVE,
              help="Progress is written to status at most this often (state changes at once).")
@click.option("--size-check-interval", envvar="MODELCACHE_SIZE_CHECK_INTERVAL", default=300.0, show_default=True,
              type=_NON_NEGATIVE, help="Seconds between size checks of downloaded models (0: off).")
@click.option("--verify-interval", envvar="MODELCACHE_VERIFY_INTERVAL", default=86400.0, show_default=True,
              type=_NON_NEGATIVE, help="Seconds between full re-hashes of downloaded models (0: off).")
@click.option("--drift-check-interval", envvar="MODELCACHE_DRIFT_CHECK_INTERVAL", default=3600.0, show_default=True,
              type=_NON_NEGATIVE, help="Seconds between listings of each downloaded model's source to report in "
              "status whether it changed since the download (0: off).")
@click.option("--removal-recheck", envvar="MODELCACHE_REMOVAL_RECHECK", default=10.0, show_default=True,
              type=_POSITIVE, help="Seconds between checks of a removal that waits for a mounting pod.")
@click.option("--sweep-interval", envvar="MODELCACHE_SWEEP_INTERVAL", default=600.0, show_default=True,
              type=_NON_NEGATIVE, help="Seconds between sweeps for files of models no entry wants (0: only at start).")
@click.option("--space-margin", envvar="MODELCACHE_SPACE_MARGIN", default="256Mi", show_default=True,
              callback=_size, help="Kept free on the root's file system.")
@click.option("--host-path", envvar="MODELCACHE_HOST_PATH", default=None,
              help="The root's path on the host, as node group PVs name it (local.path). Default: read from "
                   "this agent's own Pod (POD_NAME, POD_NAMESPACE), else unknown (any PV counts).")
@click.option("--download-env", envvar="MODELCACHE_DOWNLOAD_ENV", multiple=True, callback=_env_pairs,
              help="Non-secret KEY=VALUE settings for every download (endpoints, CA bundle); repeatable.")
@click.option("--log-format", envvar="MODELCACHE_LOG_FORMAT", type=click.Choice(["logfmt", "json"]),
              default="logfmt", show_default=True)
@click.option("--log-level", envvar="MODELCACHE_LOG_LEVEL", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False))
@click.option("--peers", envvar="MODELCACHE_PEERS", type=click.Choice(["auto", "on", "off"]), default="auto",
              show_default=True, help="Peer transfer between agents (docs/peers.md); auto: on when --peer-token-file "
              "exists. Off: every byte from the origin.")
@click.option("--peer-port", envvar="MODELCACHE_PEER_PORT", default=8443, show_default=True,
              type=click.IntRange(0, 65535), help="TLS port other agents read pieces from (0: any free port).")
@click.option("--peer-host", envvar="MODELCACHE_PEER_HOST", default="0.0.0.0", show_default=True)
@click.option("--peer-address", envvar="MODELCACHE_PEER_ADDRESS", default=None,
              help="HOST[:PORT] published for other agents. [default: $POD_IP and --peer-port]")
@click.option("--peer-token-file", envvar="MODELCACHE_PEER_TOKEN_FILE", show_default=True,
              default="/var/run/secrets/modelcache/peer/token", type=click.Path(dir_okay=False, path_type=Path),
              help="ServiceAccount token for audience modelcache-peer (projected by deploy/agent).")
@click.option("--peer-tls-cert", envvar="MODELCACHE_PEER_TLS_CERT", default=None,
              type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Certificate of the peer endpoint (default: a self-signed one made at start).")
@click.option("--peer-tls-key", envvar="MODELCACHE_PEER_TLS_KEY", default=None,
              type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--peer-max-uploads", envvar="MODELCACHE_PEER_MAX_UPLOADS", default=4, show_default=True,
              type=click.IntRange(1), help="Pieces served to peers at once (more wait their turn).")
@click.option("--peer-upload-rate", envvar="MODELCACHE_PEER_UPLOAD_RATE", default="0", show_default=True,
              callback=_size, help="Bytes per second served to peers in all (e.g. 200Mi; 0: unlimited).")
@click.option("--peer-wait", envvar="MODELCACHE_PEER_WAIT", default=20.0, show_default=True, type=_POSITIVE,
              help="Longest wait for a piece another node reads from the origin before reading it ourselves.")
@click.option("--peer-formation", envvar="MODELCACHE_PEER_FORMATION", default=3.0, show_default=True,
              type=_NON_NEGATIVE, help="Seconds after a download starts in which nodes still listing the model "
              "count as members of its swarm.")
@click.option("--peer-witnesses", envvar="MODELCACHE_PEER_WITNESSES", default=2, show_default=True,
              type=click.IntRange(1), help="Nodes that must have read a piece from the origin, and agree on its "
              "hash, before it is taken from a peer, for files whose source gives no unforgeable checksum "
              "(1: any one node's word; docs/peers.md).")
def cli(**kw: object) -> None:
    """Node agent: fills the node's model root from its LocalModelNode and reports status."""
    setup_logging(str(kw["log_format"]), str(kw["log_level"]))
    standalone = kw["standalone"]
    node = kw["node"] or (_spec_name(Path(str(standalone))) if standalone else None)
    if not node:
        raise click.UsageError("--node (or NODE_NAME) is required outside --standalone")
    if standalone:
        # A workstation, not a node: health and metrics on loopback, on any free port (a second
        # agent then says that another agent holds its root, not that port 8080 is taken).
        ctx = click.get_current_context()
        for name, value in (("port", 0), ("host", "127.0.0.1")):
            if ctx.get_parameter_source(name) == click.core.ParameterSource.DEFAULT:
                kw[name] = value
    host_path = kw.pop("host_path")
    cfg = AgentConfig(node=str(node), **{k: v for k, v in kw.items() if k != "node"})  # type: ignore[arg-type]
    sys.exit(run(cfg, str(host_path) if host_path else None))


env_for_every_flag(cli, "MODELCACHE_")


def run(cfg: AgentConfig, host_path: str | None = None) -> int:
    from agent.core import Agent
    from agent.credentials import Credentials, KubeSecretReader
    from agent.inuse import KubeMountChecker, NoMounts
    from agent.metrics import AgentMetrics
    from modelcache.store import NodeStore, RootLock

    spec = _standalone_spec(cfg) if cfg.standalone is not None else None  # before anything is written
    if spec is not None:
        _check_first_take(cfg, spec)
    try:
        check_buffers(cfg.workers, cfg.chunk_size,
                      f"--workers {cfg.workers} x --chunk-size {human_bytes(cfg.chunk_size)}",
                      models=cfg.max_concurrent_models)
    except ModelcacheError as exc:
        raise StartupError(f"{exc} (or --max-concurrent-models)") from None
    # Checked first: a read-only or unwritable root would otherwise fail every download later.
    check_writable_dir(cfg.root, "--root")
    metrics = AgentMetrics()
    log.info("agent starting", extra=fields(node=cfg.node, root=str(cfg.root), standalone=bool(cfg.standalone),
                                            max_concurrent_models=cfg.max_concurrent_models, workers=cfg.workers))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    root_lock = RootLock(cfg.root)
    if cfg.standalone is not None:
        from agent.standalone import StandaloneRunner

        agent = Agent(cfg, Credentials(None, cfg.download_env), NoMounts(), metrics)
        runner = StandaloneRunner(agent, cfg.standalone, cfg.watch, spec)
        server = _serve(cfg, agent.alive, agent.spec_seen.is_set, metrics.render)
        try:
            if not root_lock.acquire(stop):
                return 0
            agent.store.mark_agent_owned(f"modelcache-agent --standalone {cfg.standalone}")
            return runner.run()
        finally:
            root_lock.release()
            if server is not None:
                server.stop()

    from agent import hostpath
    from agent.kubemode import KubeRunner, NodeObjects
    from agent.ports import Ports
    from modelcache.kube.client import Kube, check_api_server, config_source, in_pod, load_api_client

    api = load_api_client(cfg.kubeconfig)  # a KubeConfigError is a StartupError: one line, exit 2
    # In a pod the API server may be out of reach for a while as the node starts: wait for it as
    # the informers would, before the agent's own Pod is read. A kubeconfig given by hand that
    # reaches nothing fails at once, after the ports (each start-up problem named by its own flag).
    in_cluster = cfg.kubeconfig is None and in_pod()
    if in_cluster and not check_api_server(api, config_source(None), stop=stop, patience=60.0):
        return 0
    kube = Kube(api)
    if host_path is None:
        host_path = hostpath.discover(kube, cfg.node, os.environ.get("POD_NAMESPACE"), os.environ.get("POD_NAME"),
                                      cfg.root)
    if host_path is None:
        log.warning("the model root's host path is unknown (no --host-path, not in a pod with a hostPath root): "
                    "pods mounting any PV keep a model from removal", extra=fields(root=str(cfg.root)))
    else:
        log.info("model root found", extra=fields(root=str(cfg.root), host_path=host_path))
    paths = hostpath.RootPaths(host_path)
    creds = Credentials(KubeSecretReader(kube, cfg.credentials_namespace, cfg.kserve_config), cfg.download_env)
    objects = NodeObjects(kube, cfg.node)
    # Live but not ready while another agent holds the root: it neither downloads nor writes status.
    # The runner is built once the root is held (peers are served only by its holder).
    running: list[KubeRunner] = []
    server = _serve(cfg, lambda: all(r.healthy() for r in running), lambda: any(r.ready() for r in running),
                    metrics.render)
    peering = None
    try:
        if not root_lock.acquire(stop):
            log.info("agent stopping before it started", extra=fields(node=cfg.node))
            return 0
        reached: list[bool] = []

        def reach() -> None:  # once, after the local checks (token file, peer port): each names its flag
            if not in_cluster and not reached:
                check_api_server(api, config_source(cfg.kubeconfig))
                reached.append(True)

        changed = threading.Event()  # the agent's "write the status now", also peering's
        peering = _peering(cfg, kube, NodeStore.at(cfg.root), metrics, changed.set, reach, objects.event)
        ports = Ports(jobs=objects.download_jobs(cfg.job_namespace, host_path), root_check=paths.refusal,
                      peering=peering, events=objects.event)
        agent = Agent(cfg, creds, KubeMountChecker(kube, cfg.node, paths), metrics, ports=ports, changed=changed)
        krunner = KubeRunner(agent, objects, paths, peering)
        running.append(krunner)
        reach()
        try:
            krunner.start()
        except TimeoutError as exc:
            raise StartupError(f"{exc}; check the agent's RBAC (deploy/rbac/agent.yaml) and the CRDs "
                               "(kubectl apply -k deploy/)") from None
        log.info("agent running", extra=fields(node=cfg.node, port=server.port if server else -1))
        stop.wait()
        log.info("agent stopping", extra=fields(node=cfg.node))
        krunner.stop()
    finally:
        if peering is not None:
            peering.stop()
        root_lock.release()
        if server is not None:
            server.stop()
    return 0


def _spec_name(path: Path) -> str:
    """``metadata.name`` of the file's LocalModelNode (what the logs name as the node), else
    "standalone"; the file is checked properly before anything is done (``_standalone_spec``)."""
    import yaml

    try:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "LocalModelNode":
                # A file a person wrote, not yet checked: read by hand, since meta() assumes what the
                # API server validated (metadata a map, its name a string).
                name = (doc.get("metadata") or {}).get("name")
                return str(name) if isinstance(name, str) and name else "standalone"
    except (OSError, yaml.YAMLError):
        pass
    return "standalone"


def _standalone_spec(cfg: AgentConfig) -> dict[str, object]:
    """The spec file, read and checked before the root is touched: an invalid one is refused with
    one line per problem (exit 2) and nothing on disk changes."""
    from agent.standalone import InvalidSpecError, read_node

    assert cfg.standalone is not None
    try:
        return read_node(cfg.standalone)
    except InvalidSpecError as exc:
        raise StartupError(
            f"--standalone {cfg.standalone}: {len(exc.problems)} problem(s) above, so nothing was done and "
            f"nothing in {cfg.root} changed; fix the file (see docs/agent.md, \"Standalone mode\") and run again",
            [f"--standalone {cfg.standalone}: {p}" for p in exc.problems]) from None
    except ModelcacheError as exc:
        raise StartupError(f"--standalone: {exc}") from None


def _check_first_take(cfg: AgentConfig, spec: dict[str, object]) -> None:
    """The first time a standalone agent takes a root, it refuses one that holds models it did not
    download and its file does not list (a root that `modelcache pull` filled): from then on it
    deletes every model the file does not list. ``--take-root`` lets it."""
    from modelcache.kube.types import LocalModelNode
    from modelcache.sources.uri import redact_uri, storage_key
    from modelcache.store import NodeStore

    if cfg.take_root or not cfg.root.is_dir():
        return
    store = NodeStore.at(cfg.root)
    if store.agent_owned():
        return
    listed = {storage_key(i.source_model_uri) for i in LocalModelNode.from_dict(spec).spec.local_models}
    found = []
    for key in sorted(set(store.keys()) - listed):
        manifest = store.manifest(key) or store.pinned_manifest(key)
        if manifest is not None:
            found.append(f"{key} ({redact_uri(manifest.uri)})")
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise StartupError(
            f"--root {cfg.root} holds {len(found)} model(s) that no agent downloaded and {cfg.standalone} does not "
            f"list: {shown}. The standalone agent deletes every model its file does not list, so nothing was done: "
            f"add them to the file, point --root at a folder of the agent's own, or pass --take-root to let it "
            "delete them")


def _peering(cfg: AgentConfig, kube: Kube, store: NodeStore, metrics: AgentMetrics, on_change: Callable[[], None],
             before_start: Callable[[], None], on_event: Callable[[str, str, str], None]) -> Peering | None:
    from agent.peering import start_peering

    try:
        return start_peering(cfg, kube, store, metrics, on_change, before_start, on_event)
    except OSError as exc:
        raise listen_error(exc, cfg.peer_host, cfg.peer_port, "--peer-port", "--peer-host") from None


def _serve(cfg: AgentConfig, healthy: Callable[[], bool], ready: Callable[[], bool],
           metrics: Callable[[], bytes]) -> HealthServer | None:
    if cfg.port < 0:
        return None
    try:
        server = HealthServer(cfg.host, cfg.port, healthy, ready, metrics, name="agent").start()
    except OSError as exc:
        raise listen_error(exc, cfg.host, cfg.port, "--port", "--host") from None
    log.info("serving health and metrics", extra=fields(host=cfg.host, port=server.port))
    return server


def main() -> None:
    run_command(cli, "modelcache-agent")


if __name__ == "__main__":
    main()
