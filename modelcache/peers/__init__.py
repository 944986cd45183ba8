"""Peer transfer: agents of one cluster fill each other, so a node group reads the origin once.

- ``pieces``: piece geometry, hashes, the staging log and the published piece record.
- ``protocol``: the two endpoints (``have``, ranged ``files``) and their strict parsing.
- ``server``: the TLS peer server (bearer-token auth, upload slots, upload rate).
- ``client``: pinned-certificate connections to peers.
- ``local``: what this node serves of a model it is downloading.
- ``swarm``: one model's peers, and where each piece comes from (peer, origin, wait).
- ``source``: the peer-aware source the transfer engine reads through.
- ``network``: the node's downloads with peers and its catalog for the server.

The protocol, its authentication and its limits: docs/peers.md.
"""
