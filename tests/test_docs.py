"""The docs cannot drift from the code: every command, sub-command and flag that README.md, docs/
and deploy/README.md show exists; every `make` target they name is in the Makefile; every
MODELCACHE_* variable they name is read somewhere; every relative link resolves; and `--help`
shows the environment variable of every flag that has one (all of the agent's and coordinator's)."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from tests.helpers import REPO

DOCS = [REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
# `helm install modelcache ...` (and upgrade, rollback, uninstall, history) names a Helm release.
_COMMAND = re.compile(r"(?<![\w/.$-])(?<!install )(?<!upgrade )(?<!rollback )(?<!history )"
                      r"(modelcache-agent|modelcache-coordinator|modelcache)(?=[ \t]|$)(.*)$", re.M)
_FLAG = re.compile(r"^--[a-z][a-z0-9-]*")


def _commands() -> dict[str, click.Command]:
    from agent.__main__ import cli as agent_cli
    from coordinator.__main__ import cli as coordinator_cli
    from modelcache.cli import cli as modelcache_cli

    return {"modelcache": modelcache_cli, "modelcache-agent": agent_cli, "modelcache-coordinator": coordinator_cli}


def _code(text: str) -> list[str]:
    """Code as the docs show it: fenced blocks and inline spans (one string each)."""
    fenced = _FENCE.findall(text)
    rest = _FENCE.sub("", text)
    return [*fenced, *_INLINE.findall(rest)]


def _options(cmd: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for p in cmd.params:
        if isinstance(p, click.Option):
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def _invocations() -> list[tuple[str, str, str]]:
    """(doc, program, the rest of the line) for every command line in the docs' code."""
    out = []
    for doc in DOCS:
        for code in _code(doc.read_text()):
            last = None
            for line in code.splitlines():
                line = re.split(r"\s#\s", line, maxsplit=1)[0]  # a shell comment
                found = [(doc.name, m.group(1), m.group(2)) for m in _COMMAND.finditer(line)]
                if found:
                    out.extend(found)
                    last = found[-1][1]
                elif last and line.strip().startswith("--"):  # a usage block's continuation line
                    out.append((doc.name, last, " " + line.strip()))
                else:
                    last = None
    return out


def test_the_docs_show_commands() -> None:
    progs = {p for _d, p, _r in _invocations()}
    assert progs == {"modelcache", "modelcache-agent", "modelcache-coordinator"}, progs


def _check(doc: str, prog: str, rest: str, commands: dict[str, click.Command]) -> list[str]:
    cmd = commands[prog]
    allowed = _options(cmd)
    tokens = [t.strip("[](){},;:'\"") for t in rest.split()]
    problems = []
    if isinstance(cmd, click.Group):
        words = [t for t in tokens if t and not t.startswith("-")]
        sub = cmd.commands.get(words[0]) if words else None
        if words and sub is None and re.fullmatch(r"[a-z]+", words[0]) and not tokens[0].startswith("-"):
            problems.append(f"{doc}: `{prog} {rest.strip()}`: no sub-command '{words[0]}'")
        if sub is not None:
            allowed |= _options(sub)
    for t in tokens:
        for part in t.split("|"):  # [--root DIR | --dest DIR], --direct-io|--no-direct-io
            m = _FLAG.match(part)
            if m and m.group(0) not in allowed:
                problems.append(f"{doc}: `{prog} {rest.strip()}`: no flag {m.group(0)}")
    return problems


def test_every_command_and_flag_in_the_docs_exists() -> None:
    commands = _commands()
    problems = [p for doc, prog, rest in _invocations() for p in _check(doc, prog, rest, commands)]
    assert problems == []


def test_the_check_catches_a_flag_or_sub_command_that_does_not_exist() -> None:
    commands = _commands()
    assert _check("x.md", "modelcache", " pull URI --no-such-flag", commands) == [
        "x.md: `modelcache pull URI --no-such-flag`: no flag --no-such-flag"]
    assert "x.md: `modelcache stats --root DIR`: no sub-command 'stats'" in _check(
        "x.md", "modelcache", " stats --root DIR", commands)
    assert _check("x.md", "modelcache-agent", " --standalone F --root D [--watch]", commands) == []


def test_every_make_target_in_the_docs_exists() -> None:
    targets = set(re.findall(r"^([A-Za-z0-9_-]+):", (REPO / "Makefile").read_text(), re.M))
    named = set()
    for doc in DOCS:
        for code in _code(doc.read_text()):
            for m in re.finditer(r"^(?:\$ )?make((?:[ \t]+[a-z][a-z0-9-]*(?=[ \t]|$))+)", code, re.M):
                named |= {(doc.name, t) for t in m.group(1).split()}
    assert {t for _d, t in named} >= {"demo", "test", "image", "push"}
    assert sorted(f"{d}: make {t}" for d, t in named if t not in targets) == []


def test_every_modelcache_variable_in_the_docs_is_read_somewhere() -> None:
    sources = "".join(p.read_text(errors="replace") for folder in ("modelcache", "agent", "coordinator",
                                                                   "initializer", "tests", "deploy", "bench")
                      for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".yaml", ".sh"))
    sources += (REPO / "Makefile").read_text()
    mentioned = {(doc.name, v) for doc in DOCS for v in re.findall(r"\bMODELCACHE_[A-Z0-9_]*[A-Z0-9]\b",
                                                                    doc.read_text())}
    assert sorted(f"{d}: {v}" for d, v in mentioned if v not in sources and not v.endswith("_")) == []


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.name}: {target}")
    assert broken == []


@pytest.mark.parametrize("prog", ["modelcache-agent", "modelcache-coordinator", "modelcache"])
def test_help_shows_the_environment_variable_of_every_flag(prog: str) -> None:
    cmd = _commands()[prog]
    subs = list(cmd.commands.values()) if isinstance(cmd, click.Group) else []
    for c in [cmd, *subs]:
        args = [c.name] if c is not cmd else []
        text = " ".join(CliRunner().invoke(cmd, [*args, "--help"], terminal_width=200).output.split())
        for p in c.params:
            if not isinstance(p, click.Option):
                continue
            if prog != "modelcache":
                assert p.envvar, f"{prog} {p.opts[0]} has no environment variable"
            for name in [p.envvar] if isinstance(p.envvar, str) else (p.envvar or []):
                assert name in text, f"{prog} {' '.join(args)} --help does not show {name} for {p.opts[0]}"


def test_the_credential_namespace_rule_is_stated_once() -> None:
    # One place says where credentials live; every other mention links to it.
    stated = [doc.name for doc in DOCS if "Download credentials live in one namespace" in doc.read_text()]
    assert stated == ["install.md"]
    for doc in DOCS:
        text = doc.read_text()
        if "credential namespace" in text.lower() and doc.name != "install.md":
            assert "install.md#credentials" in text, doc.name


def test_install_md_manifests_are_accepted_and_its_kubectl_get_shows_those_columns(cluster) -> None:
    """install.md's YAML is what the API server takes (schemas of deploy/crds), and the `kubectl
    get localmodelcaches,localmodelnodes` output it shows has the columns kubectl prints."""
    text = (REPO / "docs" / "install.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)
    assert len(blocks) == 3, blocks
    for block in blocks:
        cluster.kubectl("apply", "-f", "-", input=block)  # fails the test on any refused field
    cluster.kubectl("apply", "-f", "-", input="apiVersion: serving.kserve.io/v1alpha1\nkind: LocalModelNode\n"
                                              "metadata: {name: node-1}\nspec: {localModels: []}\n")
    got = cluster.kubectl("get", "localmodelcaches,localmodelnodes").stdout
    headers = [ln.split() for ln in got.splitlines() if ln.startswith("NAME")]
    shown = [ln.split() for block in _FENCE.findall(text) for ln in block.splitlines() if ln.startswith("NAME ")]
    assert len(shown) == 4 and all(h in headers for h in shown), (shown, headers)
    rows = [ln.split() for ln in got.splitlines() if ln.startswith("localmodelcache")]
    assert rows and rows[0][:2] == ["localmodelcache.serving.kserve.io/llm", "s3://models/llm"], got


def test_every_test_failures_md_names_exists() -> None:
    """docs/failures.md lists each failure with the test that shows it: every `tests/x.py::name`
    (and the `::name` shorthand after it, meaning the same file) is a test function there."""
    text = (REPO / "docs" / "failures.md").read_text()
    missing = []
    for row in text.splitlines():
        current = None
        for m in re.finditer(r"`(tests/[\w/]+\.py)?(::([\w]+)(\[[^\]]*\])?)?`", row):
            path, name = m.group(1), m.group(3)
            if path:
                current = REPO / path
                if not current.is_file():
                    missing.append(path)
                    continue
            if name and current is not None and not re.search(rf"^\s*def {name}\(", current.read_text(), re.M):
                missing.append(f"{current.relative_to(REPO)}::{name}")
    assert missing == []


def test_development_md_describes_every_set_up_script_and_its_lane() -> None:
    """docs/development.md's table has one row per tests/setup.d script, and says `go` exactly for
    the scripts `make test-servers` leaves out (the build lane, tests/setup.sh)."""
    text = (REPO / "docs" / "development.md").read_text()
    rows = dict(re.findall(r"^\| `(\d\d-[a-z0-9-]+\.sh)` \|(?:[^|\n]*\|){2} (servers|go) \|", text, re.M))
    scripts = sorted((REPO / "tests" / "setup.d").glob("*.sh"))
    assert sorted(rows) == [p.name for p in scripts]
    for p in scripts:
        built = bool(re.search(r"^# lane: build", p.read_text(), re.M))
        assert rows[p.name] == ("go" if built else "servers"), p.name


def test_development_md_names_every_tier_and_lane() -> None:
    from tests import tiers

    text = (REPO / "docs" / "development.md").read_text()
    for mark in tiers.MARKERS:
        assert f"`{mark}`" in text, mark
    for lane in ("make check", "make test-servers", "make test"):
        assert f"`{lane}`" in text, lane


def test_every_test_the_docs_name_exists() -> None:
    """A test (or class) named as `tests/x.py::name` (how to run one) is one of that file."""
    missing = []
    for doc in DOCS:
        for path, name in re.findall(r"(tests/[a-z0-9_/]+\.py)::([A-Za-z0-9_]+)", doc.read_text()):
            source = REPO / path
            if not source.exists() or not re.search(rf"^\s*(?:def|class) {name}\b", source.read_text(), re.M):
                missing.append(f"{doc.name}: {path}::{name}")
    assert missing == []
