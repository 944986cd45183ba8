"""The agent in a user's first week (issue 27): each cache judged in its own node group (the race
review's finding 2), one space margin and no gc advice on the agent's root (finding 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.capacity import GroupLimit
from modelcache.kube.types import LocalModelInfo
from modelcache.sources.uri import storage_key
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
    agent.set_group_limit("big", GroupLimit(100 * MiB, "big"))
    agent.set_group_limit("small", GroupLimit(3 * MiB, "small"))
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
        agent.set_group_limit("small", GroupLimit(8 * MiB, "small"))
        wait_until(lambda: agent.status()["modelStatus"] == {"p": D, "q": D}, timeout=30, what="p fits now")
        assert nginx.access_log() == []
    finally:
        agent.stop()


def test_no_group_with_room_refuses_the_download_naming_a_group_of_its_own(nginx: Any, tmp_path: Path) -> None:
    nginx.write("g/m.bin", 4 * MiB)
    uri = nginx.url("g/m.bin")
    agent = make_agent(tmp_path)
    agent.set_group_limit("a", GroupLimit(2 * MiB, "a"))
    agent.set_group_limit("b", GroupLimit(3 * MiB, "b"))
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
    from agent.report import seconds

    assert [seconds(d) for d in (0.2, 0.5, 1.0, 2.5, 10, 75, 300)] == [
        "0.2s", "0.5s", "1s", "2.5s", "10s", "1m15s", "5m00s"]


def test_a_yaml_syntax_error_under_watch_is_a_spec_valid_condition_naming_the_line(nginx: Any, tmp_path: Path) -> None:
    """C5: breaking the file with a missing `}` under --watch was only logged (`ParserError ...
    "<unicode string>"`), and the status file had no condition, as agent.md promised."""
    import subprocess

    import yaml

    from tests.agent_util import agent_cmd
    from tests.helpers import REPO

    nginx.write("w/m.bin", 1 * MiB)
    uri = nginx.url("w/m.bin")
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": uri}])
    root = tmp_path / "root"
    proc = subprocess.Popen(agent_cmd(spec, root, "--watch"), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: spec.with_name(spec.name + ".status.yaml").exists()
                   and status_of(spec)["modelStatus"] == {"m": D}, timeout=30, what="downloaded")
        spec.write_text("apiVersion: serving.kserve.io/v1alpha1\nkind: LocalModelNode\nmetadata: {name: box}\n"
                        "spec:\n  localModels:\n  - {modelName: m, sourceModelUri: " + uri + "\n")

        def condition() -> dict[str, Any] | None:
            conds = status_of(spec).get("conditions") or []
            return conds[0] if conds else None

        wait_until(lambda: condition() is not None, timeout=30, what="a SpecValid condition")
        cond = condition()
        assert cond is not None and (cond["type"], cond["status"], cond["reason"]) == ("SpecValid", "False",
                                                                                       "InvalidSpec")
        assert "line 7, column 1: not valid YAML: expected ',' or '}'" in cond["message"], cond["message"]
        assert "line 6, column 5" in cond["message"] and "<unicode string>" not in cond["message"]
        assert status_of(spec)["modelStatus"] == {"m": D}  # the last valid spec stays
        assert (root / "models" / storage_key(uri) / "m.bin").exists()
        # Fixed again: the condition goes.
        write_node(spec, [{"modelName": "m", "sourceModelUri": uri}])
        wait_until(lambda: condition() is None, timeout=30, what="the condition cleared")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "<unicode string>" not in err
    assert yaml.safe_load(spec.read_text())["kind"] == "LocalModelNode"


def test_a_one_shot_run_ends_with_an_error_line_per_failed_model(nginx: Any, tmp_path: Path) -> None:
    """C13: a one-shot run with a 404 entry exited 1 after a warning with `retry_in=5.0` (no retry
    came) and no `error:` line naming the model."""
    nginx.write("o/ok.bin", 1 * MiB)
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "ok", "sourceModelUri": nginx.url("o/ok.bin")},
                                                {"modelName": "gone", "sourceModelUri": nginx.url("o/gone.bin")}])
    proc = run_agent(spec, tmp_path / "root")
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 2, proc.stderr
    gone = nginx.url("o/gone.bin")
    assert lines[0].startswith(f"error: gone: NotFound: {gone}: HTTP 404") and "retry" not in lines[0], lines[0]
    assert lines[1] == (f"error: 1 of 2 model(s) not downloaded; status in {spec}.status.yaml; run again, or with "
                        "--watch to retry with backoff")
    failed = [ln for ln in proc.stderr.splitlines() if 'msg="download failed"' in ln]
    assert failed and all("retry_in" not in ln for ln in failed)
    assert proc.stderr.rstrip().endswith(lines[1])  # the last line the user sees
    # The logs name the node as the file does (it said node=standalone).
    assert "node=box" in proc.stderr and "node=standalone" not in proc.stderr


def test_standalone_says_it_ignores_credential_fields(nginx: Any, tmp_path: Path) -> None:
    """C4: `serviceAccountName: some-sa` was accepted without a word and ignored."""
    nginx.write("c/m.bin", 1 * MiB)
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": nginx.url("c/m.bin"),
                                                "serviceAccountName": "some-sa"}])
    proc = run_agent(spec, tmp_path / "root")
    assert proc.returncode == 0, proc.stderr
    warned = [ln for ln in proc.stderr.splitlines() if "credential fields are ignored" in ln]
    assert len(warned) == 1 and "level=warning" in warned[0] and 'entry="m: serviceAccountName"' in warned[0], \
        proc.stderr
    assert "come from the agent's environment and --download-env" in warned[0]
    # Without keys in its environment, the error names where a standalone agent reads them (it
    # said "set AWS_ACCESS_KEY_ID ... (or the storage-spec secret)": there is none without a cluster).
    import os
    import subprocess

    from tests.agent_util import agent_cmd
    from tests.helpers import REPO

    s3 = write_node(tmp_path / "s3.yaml", [{"modelName": "s", "sourceModelUri": "s3://models/llm"}])
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    proc = subprocess.run(agent_cmd(s3, tmp_path / "root-s3"), cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 1
    want = ("Unauthorized: s3://models/llm: no AWS credentials: check the agent's environment and --download-env, "
            "use IRSA, or awsAnonymousCredential=true for a public bucket")
    assert status_of(s3)["modelDetails"]["s"]["message"] == want
    assert f"error: s: {want}" in proc.stderr.splitlines() and "storage-spec secret" not in proc.stderr


def test_two_standalone_agents_do_not_fight_over_a_port(nginx: Any, tmp_path: Path) -> None:
    """C13: a second standalone agent (even for another root) died with `cannot listen on
    127.0.0.1:8080`; the health server bound :: (every interface) by default."""
    import subprocess
    import sys

    from tests.helpers import REPO

    nginx.write("p/m.bin", 2 * MiB)
    nginx.set_limit_rate("p", 256 << 10)
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": nginx.url("p/m.bin")}])
    cmd = [sys.executable, "-m", "agent", "--standalone", str(spec), "--backoff-initial", "0.5"]
    first = subprocess.Popen([*cmd, "--root", str(tmp_path / "r1"), "--watch"], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    bound: set[tuple[str, int]] = set()
    try:
        wait_until(lambda: (tmp_path / "r1" / ".modelcache" / "agent.lock").exists(), timeout=30, what="first agent")
        wait_until(lambda: bool(bound.update(listening(first.pid)) or bound), timeout=30, what="its health server")
        other = subprocess.run([*cmd, "--root", str(tmp_path / "r2")], cwd=REPO, capture_output=True, text=True,
                               timeout=90)
        assert other.returncode == 0, other.stderr
        assert "already in use" not in other.stderr
        served = [ln for ln in other.stderr.splitlines() if 'msg="serving health and metrics"' in ln]
        assert served and "port=8080" not in served[0], other.stderr
        log = tmp_path / "same.log"
        with open(log, "w") as out:
            same = subprocess.Popen([*cmd, "--root", str(tmp_path / "r1")], cwd=REPO, stdout=subprocess.DEVNULL,
                                    stderr=out, text=True)
        try:
            wait_until(lambda: "another agent is running on this root: waiting for it to stop" in log.read_text(),
                       timeout=60, what="the second agent on the same root waits")
        finally:
            same.terminate()
            same.wait(30)
    finally:
        first.terminate()
        _, err = first.communicate(timeout=30)
    import re

    served = re.search(r'msg="serving health and metrics" host=(\S+) port=(\d+)', err)
    assert served and served.group(1) == "127.0.0.1" and served.group(2) != "8080", err
    # It listened on loopback only (what the kernel says the agent's sockets are bound to): the
    # metrics of a workstation are not on every interface.
    assert bound == {("127.0.0.1", int(served.group(2)))}, bound


def test_sigterm_mid_download_keeps_the_staged_progress_in_the_status(nginx: Any, tmp_path: Path) -> None:
    """Cosmetic: after SIGTERM mid-download the status kept bytesTotal but dropped bytesDone."""
    import signal
    import subprocess

    from tests.agent_util import agent_cmd
    from tests.helpers import REPO

    nginx.write("s/m.bin", 8 * MiB)
    nginx.set_limit_rate("s", 1 * MiB)
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": nginx.url("s/m.bin")}])
    proc = subprocess.Popen(agent_cmd(spec, tmp_path / "root", "--watch"), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: spec.with_name(spec.name + ".status.yaml").exists() and
                   (status_of(spec)["modelDetails"]["m"].get("bytesDone") or 0) >= 3 * MiB, timeout=60,
                   what="3 MiB downloaded")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    d = status_of(spec)["modelDetails"]["m"]
    assert d["state"] == "ModelDownloadPending" and d["message"].startswith("interrupted"), d
    assert d["bytesTotal"] == 8 * MiB and d["bytesDone"] >= 2 * MiB, d


def test_a_staged_orphan_is_named_by_its_uri_in_the_log(nginx: Any, tmp_path: Path) -> None:
    """Cosmetic: removing a staged download no entry wants logged `uri=""`."""
    from tests.pull_helpers import popen_cli

    nginx.write("o/big.bin", 8 * MiB)
    nginx.set_limit_rate("o", 1 * MiB)
    nginx.write("keep/m.bin", 1 * MiB)
    big, keep = nginx.url("o/big.bin"), nginx.url("keep/m.bin")
    root = tmp_path / "root"
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "keep", "sourceModelUri": keep}])
    assert run_agent(spec, root).returncode == 0  # the agent's root
    pull = popen_cli("pull", big, "--root", str(root), "--progress", "none", "--workers", "1")
    staging = root / ".modelcache" / "staging" / storage_key(big)
    wait_until(lambda: (staging / "plan.json").exists(), timeout=30, what="a staged download")
    import signal

    pull.send_signal(signal.SIGINT)
    pull.communicate(timeout=30)
    proc = run_agent(spec, root)
    assert proc.returncode == 0, proc.stderr
    removing = [ln for ln in proc.stderr.splitlines() if "no entry wants: removing" in ln]
    assert removing and f"uri={big}" in removing[0] and 'uri=""' not in proc.stderr, proc.stderr
    assert not staging.exists()


def test_the_agent_keeps_a_folder_it_did_not_make_and_names_it_once(nginx: Any, tmp_path: Path) -> None:
    """D1 on the agent's side: a folder under models/ that modelcache never made (here a copy
    KServe's agent left, as the review put under the CLI's root) is kept by the agent, which
    deletes every model its spec does not list, and named once at warning level with the command
    that deletes it; `modelcache ls` of the agent's root lists it with its real size."""
    import re

    from tests.pull_helpers import run_cli

    root = tmp_path / "root"
    foreign = root / "models" / "kserve-cached-abc"
    foreign.mkdir(parents=True)
    (foreign / "w.bin").write_bytes(b"k" * (3 * MiB))
    nginx.write("f/m.bin", 1 * MiB)
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": nginx.url("f/m.bin")}])
    for _ in range(2):  # the first start, and a later one: kept both times
        proc = run_agent(spec, root)
        assert proc.returncode == 0, proc.stderr
        told = [ln for ln in proc.stderr.splitlines() if "was not made by modelcache" in ln]
        assert len(told) == 1 and "level=warning" in told[0], proc.stderr
        assert f'command="modelcache rm --root {root} kserve-cached-abc"' in told[0], told[0]
        assert "kserve-cached-abc" not in "".join(ln for ln in proc.stderr.splitlines() if "deleted" in ln)
        assert (foreign / "w.bin").stat().st_size == 3 * MiB
    assert status_of(spec)["modelStatus"] == {"m": D}
    ls = run_cli("ls", "--root", str(root))
    assert re.search(r"^kserve-cached-abc\s+not modelcache's\s+3\.0 MiB\s+1\s+\(not made by modelcache\)$",
                     ls.stdout, re.M), ls.stdout


def test_lock_files_go_with_the_models_the_agent_deletes(nginx: Any, tmp_path: Path) -> None:
    """The race review's finding 5 (exp4, the agent's side): after the agent deleted models a, b,
    d and e (their caches deleted), `.modelcache/locks/` still held a lock file for all five keys."""
    uris = {}
    for n in "abcde":
        nginx.write(f"l/{n}.bin", 100_000, seed=ord(n))
        uris[n] = nginx.url(f"l/{n}.bin")
    root = tmp_path / "root"
    spec = write_node(tmp_path / "node.yaml", [{"modelName": n, "sourceModelUri": u} for n, u in uris.items()])
    assert run_agent(spec, root).returncode == 0
    locks = root / ".modelcache" / "locks"
    write_node(spec, [{"modelName": "c", "sourceModelUri": uris["c"]}])
    proc = run_agent(spec, root)
    assert proc.returncode == 0, proc.stderr
    assert status_of(spec)["modelStatus"] == {"c": D}
    assert sorted(p.name for p in (root / "models").iterdir()) == [storage_key(uris["c"])]
    assert sorted(p.name for p in locks.iterdir()) == [f"{storage_key(uris['c'])}.lock"], sorted(locks.iterdir())


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of each TCP socket process ``pid`` listens on, from /proc."""
    import ipaddress
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.add((str(ipaddress.ip_address(raw)), int(hexport, 16)))
    return out
