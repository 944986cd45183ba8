"""The agent's settings: one plain dataclass, filled from flags (each with an env default)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelcache.engine.transfer import TransferOptions

DEFAULT_ROOT = "/mnt/models"


@dataclass(frozen=True)
class AgentConfig:
    node: str
    root: Path = Path(DEFAULT_ROOT)
    #: Models downloading at once, and transfer workers (parallel ranged reads) per model.
    max_concurrent_models: int = 2
    workers: int = 8
    chunk_size: int = 16 << 20
    #: Attempts per chunk inside one download (the engine's own retries).
    transfer_attempts: int = 6
    #: Seconds a stream may deliver nothing before it is cut and retried; a piece waits for peers
    #: at most half of it (docs/peers.md).
    stall_timeout: float = 30.0
    #: Full resync of the LocalModelNode (level-triggered safety net).
    resync_period: float = 60.0
    #: Health and metrics port (0: pick a free one; -1: no server).
    port: int = 8080
    host: str = "::"
    #: Namespace whose secrets and service accounts hold download credentials (KServe's jobNamespace).
    credentials_namespace: str = "kserve"
    #: Where KServe's download-Job containers run (agent/downloadjob.py; KServe's jobNamespace).
    job_namespace: str = "modelcache-jobs"
    #: KServe's ConfigMap (namespace/name) whose ``credentials`` block holds cluster-wide defaults.
    kserve_config: str = "kserve/inferenceservice-config"
    kubeconfig: str | None = None
    standalone: Path | None = None
    watch: bool = False
    #: Standalone: take a root holding models no agent downloaded (deleting those the file does not list).
    take_root: bool = False
    #: Retry of a failed model: exponential from ``backoff_initial`` up to ``backoff_max`` seconds.
    backoff_initial: float = 5.0
    backoff_max: float = 300.0
    #: Status progress is written at most this often (state changes are written at once).
    status_interval: float = 3.0
    #: Cheap size check of every downloaded model, and a full re-hash (0 turns either off).
    size_check_interval: float = 300.0
    verify_interval: float = 86400.0
    #: How often each downloaded model's source is listed and compared with what is stored
    #: (status ``modelDetails[].drift``; the model itself is left as it is). 0 turns it off.
    drift_check_interval: float = 3600.0
    #: How often a removal that waits for a mounting pod is re-checked.
    removal_recheck: float = 10.0
    #: How often files of models no entry wants (staged, repair and trash folders included) are
    #: looked for; also once when the first spec arrives (0: only then).
    sweep_interval: float = 600.0
    #: Kept free on the root's file system besides the models.
    space_margin: int = 256 << 20
    #: Non-secret settings for every download (endpoints, CA bundle, tunables): KEY=VALUE.
    download_env: dict[str, str] = field(default_factory=dict)
    log_format: str = "logfmt"
    log_level: str = "info"
    #: Peer transfer (agent/peering.py, docs/peers.md): on, off, or auto (on when the token exists).
    peers: str = "auto"
    peer_host: str = "0.0.0.0"
    peer_port: int = 8443
    #: Published for other agents: HOST[:PORT] (default: $POD_IP and ``peer_port``).
    peer_address: str | None = None
    peer_token_file: Path = Path("/var/run/secrets/modelcache/peer/token")
    peer_tls_cert: Path | None = None
    peer_tls_key: Path | None = None
    #: Uploads to peers at once, and their bytes/s together (0: unlimited).
    peer_max_uploads: int = 4
    peer_upload_rate: int = 0
    #: Longest wait for a piece another node should read from the origin, and the swarm's
    #: formation window (seconds).
    peer_wait: float = 20.0
    peer_formation: float = 3.0
    #: Nodes that must have read a piece from the origin, and agree, before it is taken from a
    #: peer, for files without an unforgeable source checksum (docs/peers.md).
    peer_witnesses: int = 2

    def space_advice(self) -> str:
        """What a refusal for lack of disk advises: never a gc of the agent's root, which holds what
        the spec lists (the agent would download the evicted models again)."""
        fewer = ("remove entries from " + str(self.standalone) if self.standalone is not None
                 else "take caches off this node's node groups")
        return f"the root holds the models its spec lists: {fewer}, give --root a larger disk, or lower --space-margin"

    def transfer_options(self) -> TransferOptions:
        """The engine's options for one download (modelcache.engine.transfer: imported here, not at start-up)."""
        from modelcache.engine.transfer import TransferOptions

        return TransferOptions(workers=self.workers, chunk_size=self.chunk_size, max_attempts=self.transfer_attempts,
                               stall_timeout=self.stall_timeout, backoff_max=min(10.0, max(0.5, self.backoff_max)))
