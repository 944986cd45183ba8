"""Who a node takes for a peer (agent/peering.py's Directory): every LocalModelNode's own word,
and the peers other nodes found lying (``status.peer.excluded``), skipped by us too."""

from __future__ import annotations

from typing import Any

from agent.peering import Directory, directory_essentials
from modelcache.sources.uri import storage_key

URI = "s3://b/llm"
KEY = storage_key(URI)


def lmn(name: str, excluded: list[str] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    peer: dict[str, Any] = {"endpoint": f"10.0.0.{len(name)}:8443", "certSHA256": "ab" * 32}
    if excluded:
        peer["excluded"] = [{"node": n, "reason": "piece 1 of a.bin has sha-256 ...", "since": "2026-01-01T00:00:00Z"}
                            for n in excluded]
    return {"metadata": {"name": name}, "spec": {"localModels": [{"modelName": "llm", "sourceModelUri": URI}]},
            "status": {"peer": peer, "modelDetails": {}}}


def test_a_peer_another_node_excluded_is_skipped_unless_we_excluded_that_node():
    directory = Directory(None, "me")  # type: ignore[arg-type]  # the store is filled by hand
    for obj in (lmn("honest", excluded=["liar"]), lmn("liar", excluded=["honest", "me"]), lmn("other"), lmn("me")):
        directory.informer.store.put(directory_essentials(obj))
    # Both accuse each other: each is skipped, at the cost of origin bytes, never of a wrong one.
    assert {p.name for p in directory.peers(KEY)} == {"other"}
    # Once we found the liar ourselves, its word about others no longer counts.
    directory.excluded = lambda node: node == "liar"
    assert {p.name for p in directory.peers(KEY)} == {"honest", "other"}
    assert directory.vetoed(directory.excluded) == {"liar"}  # "me" in its list is ignored
