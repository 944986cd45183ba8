"""Whether each namespace cache's entry may be served the model its record holds (security review H3).

Caches of one URI share one folder (KServe's contract), downloaded with the credentials of the
record's first entry (agent/state.py ``group_entries``). A namespace cache's entry is served that
folder only when it names the same credentials, granted to its namespace (agent/credentials.py);
an entry not judged yet is not reported Downloaded (the coordinator gives its namespace a serving
claim on that word).

An entry is judged before the spec that brings it is applied (``Agent.set_spec``), so no status
shows it unjudged. It was judged at the supervisor's next tick, after that tick had started the
downloads: a status derived in between (the writer wakes on the spec at once) said Pending
("checking the credentials it names") for a copy already counted, one KServe's agent reported
Downloaded or ours before a restart, dropping the cache's copies and the node's placement label for
a moment (tests/test_agent_adoption.py, seen at load ~5). Every entry is judged again every
``ENTRY_CHECK`` seconds: grants change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from agent.credentials import Credentials
from agent.logs import fields
from modelcache.kube.types import LocalModelInfo

log = logging.getLogger("agent")

#: (status key, storage key): one entry of one record.
Pair = tuple[str, str]
#: (the entry, the entry its model is downloaded with, the storage key).
Entry = tuple[LocalModelInfo, LocalModelInfo, str]
#: Seconds between two judgements of every entry (Agent.tick).
ENTRY_CHECK = 10.0


def namespace_entries(records: Iterable[tuple[str, list[LocalModelInfo]]]) -> list[Entry]:
    """The namespace caches' entries of ``records`` ((storage key, its entries, leader first))."""
    return [(info, infos[0], key) for key, infos in records for info in infos if info.namespace]


def pair(entry: Entry) -> Pair:
    return entry[0].status_key, entry[2]


def judge_entries(credentials: Credentials, entries: Iterable[Entry], known: Mapping[Pair, str]) -> dict[Pair, str]:
    """Each entry's verdict: why it may not be served its record's model, "" if it may. An entry
    whose check fails (the API server unreachable a moment) keeps its status key's last refusal."""
    refused = {key: why for (key, _storage), why in known.items() if why}
    verdicts: dict[Pair, str] = {}
    for entry in entries:
        info, primary, _ = entry
        try:
            verdicts[pair(entry)] = credentials.entry_refusal(info, primary) or ""
        except Exception as exc:
            log.warning("credential check failed", extra=fields(model=info.status_key, error=str(exc)))
            verdicts[pair(entry)] = refused.get(info.status_key, "")
    return verdicts
