"""The agent in a user's first week (issue 27): each cache judged in its own node group (the race
review's finding 2), one space margin and no gc advice on the agent's root (finding 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.capacity import GroupLimit
from modelcache.kube.types import LocalModelInfo
from modelcache.uri import storage_key
from tests.agent_util import run_agent, status_of, write_node
from tests.helpers import mounted_tmpfs, wait_until
from tests.test_agent_races import make_agent

pytestmark = pytest.mark.timeout(180)

D, E = "ModelDownloaded", "ModelDownloadError"
MiB = 1 << 20


def grouped(name: str, uri: str, group: str) -> LocalModelInfo:
    return LocalModelInfo(model_name=name, source_model_uri=uri, node_group=group)


@pytest.mark.parametrize("first", ["small", "big"])
def test_two_caches_of_one_uri_are_each_judged_in_their_own_group(nginx: Any, tmp_path: Path, first: str) -> None:
    """exp3 G / exp2 C: node n3 is in groups big (100Mi) and small (3 MiB); cache p (a 4 MiB
    model) lists [small], cache q with the same URI lists [big]. The first entry's group used to
    decide for both: with p first both failed naming 'small'; with q first p was Downloaded and
    the small group's limit not enforced."""
    nginx.write("g/m.bin", 4 * MiB)
    uri = nginx.url("g/m.bin")
    agent = make_agent(tmp_path)
    agent.group_limits.update(big=GroupLimit(100 * MiB, "big"), small=GroupLimit(3 * MiB, "small"))
    agent.start()
    try:
        entries = {"small": grouped("p", uri, "small"), "big": grouped("q", uri, "big")}
        agent.set_spec([entries[first], entries["big" if first == "small" else "small"]])
        wait_until(lambda: agent.status()["modelStatus"] == {"p": E, "q": D}, timeout=60,
                   what="q downloaded in its group, p refused in its own")
        details = agent.status()["modelDetails"]
        assert details["p"]["message"].startswith(
            f"InsufficientSpace: {uri}: does not fit the node group's storageLimit: the model is 4.0 MiB, "
            "LocalModelNodeGroup 'small' has storageLimit 3.0 MiB"), details["p"]["message"]
        assert "'big'" not in details["p"]["message"]
        assert (tmp_path / "root" / "models" / storage_key(uri) / "m.bin").stat().st_size == 4 * MiB
        # The small group grows: p is served by the same folder at once, nothing downloaded again.
        nginx.clear_access_log()
        agent.group_limits["small"] = GroupLimit(8 * MiB, "small")
        wait_until(lambda: agent.status()["modelStatus"] == {"p": D, "q": D}, timeout=30, what="p fits now")
        assert nginx.access_log() == []
    finally:
        agent.stop()


def test_no_group_with_room_refuses_the_download_naming_a_group_of_its_own(nginx: Any, tmp_path: Path) -> None:
    nginx.write("g/m.bin", 4 * MiB)
    uri = nginx.url("g/m.bin")
    agent = make_agent(tmp_path)
    agent.group_limits.update(a=GroupLimit(2 * MiB, "a"), b=GroupLimit(3 * MiB, "b"))
    agent.start()
    try:
        agent.set_spec([grouped("p", uri, "a"), grouped("q", uri, "b")])
        wait_until(lambda: agent.status()["modelStatus"] == {"p": E, "q": E}, timeout=60, what="both refused")
        assert nginx.bytes_served("g/m.bin") <= 1  # listed (and probed), refused before a download
        assert "LocalModelNodeGroup 'b' has storageLimit 3.0 MiB" in agent.status()["modelDetails"]["q"]["message"]
    finally:
        agent.stop()


def test_the_agents_space_margin_is_the_only_margin(nginx: Any, tmp_path: Path) -> None:
    """exp4b: an agent with --space-margin 1Mi on a 32 MiB file system and a 12 MiB model was
    refused by the core pull's own fixed 64 MiB margin, and told to run `modelcache gc` on its root."""
    with mounted_tmpfs(tmp_path / "fs", "size=32m") as root:
        nginx.write("m/a.bin", 12 * MiB)
        nginx.write("m/big.bin", 40 * MiB)
        ok, big = nginx.url("m/a.bin"), nginx.url("m/big.bin")
        spec = write_node(tmp_path / "node.yaml", [{"modelName": "a", "sourceModelUri": ok},
                                                    {"modelName": "big", "sourceModelUri": big}])
        proc = run_agent(spec, root, "--space-margin", "1Mi")
        assert proc.returncode == 1, proc.stderr
        st = status_of(spec)
        assert st["modelStatus"] == {"a": D, "big": E}
        msg = st["modelDetails"]["big"]["message"]
        assert "insufficient space: need 40.0 MiB" in msg and "after a 1.0 MiB margin" in msg, msg
        assert msg.endswith(f"the root holds the models its spec lists: remove entries from {spec}, give --root a "
                            "larger disk, or lower --space-margin"), msg  # a one-shot run promises no retry
        assert "gc" not in msg and "64.0 MiB" not in msg


def test_a_sub_second_backoff_is_shown_as_it_is(nginx: Any, tmp_path: Path) -> None:
    """exp2 F: with --backoff-initial 0.5 a permanent 404 said "(retry 1 in 0s)"."""
    agent = make_agent(tmp_path, backoff_initial=0.5, backoff_max=2.0).start()
    try:
        agent.set_spec([LocalModelInfo(model_name="m", source_model_uri=nginx.url("missing/m.bin"))])
        wait_until(lambda: "(retry 2 in 1s)" in (agent.status()["modelDetails"]["m"].get("message") or ""),
                   timeout=30, what="the second retry's delay")
        seen = agent.status()["modelDetails"]["m"]["message"]
        assert seen.startswith("NotFound: ") and seen.endswith("(retry 2 in 1s)"), seen
    finally:
        agent.stop()


def test_backoff_delays_read_as_people_read_them() -> None:
    from agent.core import _seconds

    assert [_seconds(d) for d in (0.2, 0.5, 1.0, 2.5, 10, 75, 300)] == [
        "0.2s", "0.5s", "1s", "2.5s", "10s", "1m15s", "5m00s"]
