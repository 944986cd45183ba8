"""Assembles registry, store and HTTP server; loads CRD manifests from directories."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.kubeapi.resources import CRD_TYPE, Registry
from tests.kubeapi.server import KubeAPIServer
from tests.kubeapi.store import Store


def load_crds(store: Store, directory: Path) -> list[str]:
    """Create every CustomResourceDefinition found in *.yaml/*.yml/*.json under `directory`."""
    names = []
    for path in sorted([*directory.rglob("*.yaml"), *directory.rglob("*.yml"), *directory.rglob("*.json")]):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                names.append(store.create(CRD_TYPE, "", doc)["metadata"]["name"])
    return names


def make_server(host: str, port: int, crd_dirs: list[Path], history: int = 1000,
                bookmark_interval: float = 5.0, verbose: bool = False) -> KubeAPIServer:
    registry = Registry()
    store = Store(registry, history_limit=history)
    for d in crd_dirs:
        load_crds(store, d)
    return KubeAPIServer((host, port), registry, store, bookmark_interval, verbose)
