"""The agent's optional parts, as typed ports its constructor takes (cluster mode fills them).

The Agent (agent/core.py) does not know Kubernetes: what it needs of the cluster is named here as
small Protocols, built by the runner (agent/__main__.py) and handed to ``Agent(..., ports=)``.
A standalone agent passes none of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from modelcache.kube.types import LocalModelInfo
from modelcache.peers.network import PeerNetwork

#: on_event(type "Normal"|"Warning", reason, message): a notable transition (cluster mode: a
#: Kubernetes Event on the LocalModelNode). Called without the agent's lock held.
EventSink = Callable[[str, str, str], None]
#: root_check(nodeGroup) -> why a model of that group must not be reported Downloaded (the root
#: is not the group PV's local.path: agent/hostpath.py), else None.
RootCheck = Callable[[str | None], "str | None"]


class DownloadJobs(Protocol):
    """KServe's download-Job containers (agent/downloadjob.py): for URIs none of our sources reads."""

    def container_for(self, uri: str) -> Mapping[str, Any] | None: ...

    def run(self, info: LocalModelInfo, key: str, folder: Path, cancel: threading.Event,
            env: Mapping[str, str]) -> str: ...


class Peers(Protocol):
    """Peer transfer (agent/peering.py): the network downloads use, and its status fields."""

    network: PeerNetwork

    def model_fields(self, key: str) -> dict[str, Any]: ...

    def status(self, keys: list[str]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Ports:
    """What the agent reaches outside itself; None: that part is off (every byte from the origin,
    no download Jobs, no Events, the root taken as every group's)."""

    jobs: DownloadJobs | None = None
    root_check: RootCheck | None = None
    peering: Peers | None = None
    events: EventSink | None = None
