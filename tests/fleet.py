"""A node group of agents with peer transfer on the real control plane (tests/test_agent_peers.py,
bench/fleet.py): the peer credential, a multi-file model on S3 behind the fault proxy (the origin,
whose bytes the proxy counts and may throttle), and checks of what landed."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelcache.kube.client import LOCAL_MODEL_NODES, Kube
from modelcache.sources.uri import storage_key
from tests.agent_util import create_secret
from tests.faultproxy import FaultProxy

AGENT_NS, AGENT_SA = "modelcache-system", "modelcache-agent"
PEER_AUDIENCE = "modelcache-peer"
STORAGE_KEY_NAME = "fleet"


def peer_token(cp: Any, folder: Path, namespace: str = AGENT_NS, service_account: str = AGENT_SA,
               audiences: list[str] | None = None) -> Path:
    """What deploy/agent projects into the agent pod: the ServiceAccount's token for the peer audience."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{namespace}.{service_account}.{'-'.join(audiences or [PEER_AUDIENCE])}.token"
    path.write_text(cp.token(namespace, service_account, audiences=audiences or [PEER_AUDIENCE]))
    path.chmod(0o600)
    return path


def peer_args(token: Path, port: int = 0, address: str = "127.0.0.1", *extra: str) -> list[str]:
    return ["--peers", "on", "--peer-token-file", str(token), "--peer-port", str(port), "--peer-host", "127.0.0.1",
            "--peer-address", address, "--peer-formation", "3", *extra]


def model_files(total: int, shards: int, seed: int = 1) -> dict[str, bytes]:
    """A model-shaped folder: a small config and ``shards`` weight files of about ``total`` bytes."""
    rng = random.Random(seed)
    files = {"config.json": json.dumps({"model_type": "fleet", "shards": shards}).encode()}
    size = max(1, total // shards)
    for i in range(shards):
        files[f"model-{i + 1:05d}-of-{shards:05d}.safetensors"] = rng.randbytes(size + i * 4099)
    return files


@dataclass
class S3Origin:
    """A model on S3 (moto) reached through a fault proxy: the origin every agent lists and reads."""

    bucket: str
    prefix: str
    proxy: FaultProxy
    files: dict[str, bytes] = field(repr=False)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def key(self) -> str:
        return storage_key(self.uri)

    @property
    def size(self) -> int:
        return sum(len(b) for b in self.files.values())

    def origin_bytes(self) -> int:
        """Body bytes the origin sent for the model's files (listings excluded)."""
        with self.proxy._lock:
            return sum(n for p, n in self.proxy.bytes_sent.items() if p.startswith(f"/{self.bucket}/{self.prefix}/"))


def upload_model(s3: Any, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    for name, body in files.items():
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body)


def storage_secret(kube: Kube, endpoint: str, access_key: str, secret_key: str, name: str = "storage-config") -> None:
    """The storage-config secret (KServe's) in the credential namespace, with one entry, ``fleet``, for S3
    at ``endpoint``."""
    cfg = {"type": "s3", "access_key_id": access_key, "secret_access_key": secret_key, "endpoint_url": endpoint,
           "region": "us-east-1"}
    create_secret(kube, name, {STORAGE_KEY_NAME: json.dumps(cfg)})


def entry(name: str, uri: str) -> dict[str, Any]:
    return {"modelName": name, "sourceModelUri": uri, "storage": {"key": STORAGE_KEY_NAME}}


def peer_endpoint(kube: Kube, node: str) -> str:
    obj = kube.get_or_none(LOCAL_MODEL_NODES, node) or {}
    return str(((obj.get("status") or {}).get("peer") or {}).get("endpoint") or "")


def check_files(root: Path, key: str, files: dict[str, bytes]) -> None:
    """Every file of the model there, byte for byte (sha-256), nothing else but what we put."""
    base = root / "models" / key
    found = {str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()}
    assert found == set(files), f"{base}: {sorted(found)} != {sorted(files)}"
    for name, body in files.items():
        got = hashlib.sha256((base / name).read_bytes()).hexdigest()
        assert got == hashlib.sha256(body).hexdigest(), f"{base / name} differs from the source"
