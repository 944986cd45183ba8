"""What each ServiceAccount may do, asked of the real API server's authorizer: every row of the
table in docs/operations.md ("What each identity may do") is what `kubectl auth can-i` answers,
and `kubectl auth can-i --list` grants nothing beyond the table's `yes` rows."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.fixtures.cluster import Cluster
from tests.helpers import REPO
from tests.test_coordinator_llmisvc import llm_crd

pytestmark = pytest.mark.timeout(300)

DOC = REPO / "docs" / "operations.md"
SA = {"agent": "system:serviceaccount:modelcache-system:modelcache-agent",
      "coordinator": "system:serviceaccount:modelcache-system:modelcache-coordinator",
      # Any ServiceAccount, for what every one may do (system:basic-user and the like): not ours.
      "anyone": "system:serviceaccount:default:default"}
NAMESPACES = ("modelcache-system", "modelcache-credentials", "modelcache-jobs", "kserve", "default", "team")


@dataclass(frozen=True)
class Row:
    who: str
    verbs: tuple[str, ...]
    resource: str  # resource[.group][/subresource]
    namespace: str  # "—": cluster-scoped, "*": every namespace
    names: tuple[str, ...]
    may: bool


def table() -> list[Row]:
    text = DOC.read_text()
    section = text.split("## What each identity may do", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or cells[0] not in ("agent", "coordinator"):
            continue
        who, verbs, resource, namespace, names, may, _why = cells
        rows.append(Row(who, tuple(v.strip() for v in verbs.split(",")), resource, namespace,
                        () if names == "—" else tuple(n.strip() for n in names.split(",")), may == "yes"))
    assert len(rows) > 30, "the table in docs/operations.md was not found"
    return rows


def can_i(cluster: Cluster, row: Row, verb: str, name: str | None) -> bool:
    resource, _, sub = row.resource.partition("/")
    args = ["auth", "can-i", verb, f"{resource}/{name}" if name else resource, "--as", SA[row.who]]
    if sub:
        args += ["--subresource", sub]
    if row.namespace == "*":
        args += ["--all-namespaces"]
    elif row.namespace != "—":
        args += ["-n", row.namespace]
    out = cluster.kubectl(*args, check=False)
    answer = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert answer in ("yes", "no"), f"kubectl {' '.join(args)}: {out.stdout} {out.stderr}"
    return answer == "yes"


@pytest.fixture
def with_llmisvc(cluster: Cluster, tmp_path: Path) -> Cluster:
    """KServe's LLMInferenceService CRD (kubectl resolves a resource through discovery first)."""
    crd = tmp_path / "llmisvc.yaml"
    crd.write_text(yaml.safe_dump(llm_crd("v1alpha1")))
    cluster.kubectl("apply", "-f", str(crd))
    cluster.kubectl("wait", "--for", "condition=Established", "crd/llminferenceservices.serving.kserve.io")
    return cluster


def test_every_row_of_the_table_is_what_the_authorizer_answers(with_llmisvc: Cluster) -> None:
    cluster = with_llmisvc
    wrong = []
    for row in table():
        for verb in row.verbs:
            for name in row.names or (None,):
                if can_i(cluster, row, verb, name) != row.may:
                    wrong.append(f"{row.who} {verb} {row.resource} ns={row.namespace} name={name}: "
                                 f"documented {'yes' if row.may else 'no'}")
    assert wrong == []


LIST_LINE = re.compile(r"^(\S+)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*$")


def granted(cluster: Cluster, who: str, namespace: str) -> set[tuple[str, str, str]]:
    """(resource, name or "", verb) from `kubectl auth can-i --list` in ``namespace``."""
    out = cluster.kubectl("auth", "can-i", "--list", "-n", namespace, "--as", SA[who]).stdout
    grants = set()
    for line in out.splitlines()[1:]:
        m = LIST_LINE.match(line.strip())
        if not m:
            continue  # non-resource URLs
        names = m.group(3).split() or [""]
        for verb in m.group(4).split():
            for name in names:
                grants.add((m.group(1), name, verb))
    return grants


def test_nothing_is_granted_beyond_the_table(cluster: Cluster) -> None:
    rows = table()
    cluster.kubectl("create", "namespace", "team")
    cluster.kubectl("create", "namespace", "kserve")
    for who in ("agent", "coordinator"):
        for ns in NAMESPACES:
            documented = {(r.resource, name, verb) for r in rows if r.who == who and r.may
                          and r.namespace in ("—", "*", ns) for verb in r.verbs for name in r.names or ("",)}
            assert granted(cluster, who, ns) - granted(cluster, "anyone", ns) == documented, f"{who} in {ns}"


_LISTED = re.compile(r"^```\n\$ (kubectl auth can-i --list [^\n]+)\n(.*?)^```", re.M | re.S)


def _rows(text: str) -> list[list[str]]:
    """The rows of `kubectl auth can-i --list` output, each as its columns (whitespace-separated)."""
    return sorted(line.split() for line in text.strip().splitlines()[1:] if line.strip())


def test_can_i_list_of_each_service_account_is_what_the_docs_show(cluster: Cluster) -> None:
    """docs/operations.md shows `kubectl auth can-i --list` of both ServiceAccounts, verbatim: the
    API server's authorizer answers exactly that (a grant added or dropped fails here)."""
    text = DOC.read_text()
    blocks = _LISTED.findall(text)
    who = {line.split("--as=")[1].split()[0] for line, _ in blocks}
    assert who == {SA["agent"], SA["coordinator"]}, who
    for line, shown in blocks:
        command, _, pipe = line.partition(" | ")
        got = cluster.kubectl(*command.split()[1:]).stdout  # after `kubectl`
        if pipe:
            assert pipe == "grep -v '^ '", pipe  # the rows of non-resource URLs (their first column is empty)
            got = "\n".join(ln for ln in got.splitlines() if not ln.startswith(" "))
        assert _rows(got) == _rows(shown), f"{line}\n--- the API server:\n{got}"
