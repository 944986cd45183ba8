"""Nodes with peer transfer in one process (tests/test_peers.py, tests/test_peers_adversarial.py):
each a store, a PeerNetwork and a PeerServer over real TLS; the directory is a list of them (and
of any byzantine peer a test adds)."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelcache.engine.transfer import TransferOptions
from modelcache.peers.client import PeerClient, PeerInfo
from modelcache.peers.network import PeerNetwork
from modelcache.peers.server import FORBIDDEN, OK, UNAUTHENTICATED, PeerServer, cert_fingerprint, server_context
from modelcache.peers.swarm import SwarmSettings
from modelcache.pull import pull
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore

MiB = 1 << 20
TOKEN = "agent-token"


def authorize(token: str) -> str:
    return OK if token == TOKEN else (FORBIDDEN if token == "other" else UNAUTHENTICATED)


@dataclass
class Node:
    name: str
    root: Path
    network: PeerNetwork
    server: PeerServer
    info: PeerInfo


def node_factory(tmp_path: Path, infos: dict[str, PeerInfo] | None = None) -> Iterator[Callable[..., Node]]:
    """Yields ``make(name, ...)``; every node made is stopped afterwards. ``infos``: the directory
    (every node made is added; a test may add others, a byzantine peer say)."""
    from coordinator.certs import generate_self_signed

    made: list[Node] = []
    infos = {} if infos is None else infos

    def make(name: str, token: str = TOKEN, max_uploads: int = 4, upload_rate: int = 0, zone: str = "",
             **settings: float) -> Node:
        cert, key = generate_self_signed(tmp_path / f"tls-{name}", ["127.0.0.1"])
        root = tmp_path / name
        store = NodeStore.at(root)
        network = PeerNetwork(SwarmSettings(node=name, zone=zone, formation=settings.pop("formation", 1.0), **settings),
                              lambda _key: [i for n, i in list(infos.items()) if n != name], PeerClient(lambda: token),
                              store)
        server = PeerServer("127.0.0.1", 0, server_context(str(cert), str(key)), network, authorize,
                            max_uploads, upload_rate).start()
        info = PeerInfo(name, "127.0.0.1", server.port, cert_fingerprint(cert.read_text()), zone)
        infos[name] = info
        node = Node(name, root, network, server, info)
        made.append(node)
        return node

    yield make
    for node in made:
        node.server.stop()
        node.network.client.close()


def make_source(folder: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, size in sizes.items():
        out[name] = os.urandom(size)
        (folder / name).write_bytes(out[name])
    return out


def check(node: Node, uri: str, files: dict[str, bytes]) -> None:
    base = node.root / "models" / storage_key(uri)
    for name, body in files.items():
        assert hashlib.sha256((base / name).read_bytes()).digest() == hashlib.sha256(body).digest(), name


def pull_all(nodes: list[Node], uri: str, **options: Any) -> dict[str, object]:
    results: dict[str, object] = {}

    def run(node: Node) -> None:
        try:
            results[node.name] = pull(uri, root=node.root, peers=node.network, settings=options.get("settings"),
                                      options=TransferOptions(chunk_size=MiB, workers=options.get("workers", 3),
                                                              stall_timeout=options.get("stall_timeout", 30.0)))
        except BaseException as exc:  # reported below
            results[node.name] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for name, r in results.items():
        assert not isinstance(r, BaseException), (name, r)
    return results
