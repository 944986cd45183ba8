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
    from modelcache.cli.commands import cli as modelcache_cli

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


def _anchors(doc) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces
    to dashes, a repeated heading numbered -1, -2, ...) and its `<a id="...">` tags."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _FENCE.sub("", doc.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out | set(re.findall(r'<a id="([^"]+)"', doc.read_text()))


def _broken_links(doc) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path) if path else doc
        if not dest.exists():
            broken.append(f"{doc.name}: {target}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{doc.name}: {target} (no such heading)")
    return broken


def test_every_relative_link_in_the_docs_resolves() -> None:
    """Every relative link names a file a clone has and, for a Markdown file, a heading it has."""
    assert [b for doc in DOCS for b in _broken_links(doc)] == []


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path) -> None:
    (tmp_path / "b.md").write_text("# Title\n\n## The CLI: flags, `exit` codes\n\n## Again\n\n## Again\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](b.md#the-cli-flags-exit-codes) [ok](b.md#again-1) [ok](#here) [x](c.md) "
                   "[x](b.md#the-cli) [x](#nowhere) [ok](#set)\n\n## Here\n\n<a id=\"set\"></a>text\n")
    assert _broken_links(doc) == ["a.md: c.md", "a.md: b.md#the-cli (no such heading)",
                                  "a.md: #nowhere (no such heading)"]


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


def _bench_rows(text: str, results: str) -> dict[str, tuple[int, list[int]]]:
    """The table after the link to ``results`` in benchmarks.md: tool -> (median, runs) in MB/s."""
    after = text[text.index(f"]({results})"):]
    table = re.search(r"^\|.*\n\|[-:| ]+\n((?:\|.*\n)+)", after, re.M)
    assert table, f"no table after the link to {results}"
    rows = {}
    for line in table.group(1).splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = (int(cells[1]), [int(r) for r in cells[2].split(", ")])
    return rows


def test_benchmark_tables_are_their_raw_results() -> None:
    """Each raw result in bench/results/ is linked from docs/benchmarks.md, and the table after the
    link shows its runs and medians (durable MB/s, 1 MB = 10^6 B, the order the runs were taken)."""
    import json
    import statistics

    text = (REPO / "docs" / "benchmarks.md").read_text()
    results = sorted((REPO / "bench" / "results").glob("*.json"))
    assert results
    for path in results:
        runs: dict[str, list[int]] = {}
        for run in json.loads(path.read_text()):
            runs.setdefault(run["tool"], []).append(round(run["bytes"] / run["seconds"] / 1e6))
        shown = _bench_rows(text, f"../bench/results/{path.name}")
        assert len(shown) == len(runs), (path.name, shown)
        for tool, got in runs.items():
            (row,) = [v for k, v in shown.items() if k == tool or k.startswith(tool + " ")]
            assert row == (round(statistics.median(got)), got), (path.name, tool)


_DOTTED = re.compile(r"^(?:modelcache|agent|coordinator|initializer)(?:\.[A-Za-z_]\w*)+$")


def _resolves(dotted: str) -> bool:
    """``package.module.attr.attr``: the longest importable module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _flow_steps(text: str, heading: str) -> list[str]:
    """The 'function' cells of the step table under ``heading``."""
    section = text[text.index(heading):]
    table = re.search(r"^\| # \| step \| function \|.*\n\|[-| ]+\n((?:\|.*\n)+)", section, re.M)
    assert table, heading
    return [line.strip("|").split("|")[2] for line in table.group(1).splitlines()]


def test_architecture_md_names_real_functions() -> None:
    """Each step of the three flows names the function that does it, and every dotted name the
    page shows (`modelcache.pull.pull_many`, `agent.core.Agent.tick`, ...) exists."""
    text = (REPO / "docs" / "architecture.md").read_text()
    for heading in ("## The pull pipeline", "## The agent", "## The coordinator"):
        steps = _flow_steps(text, heading)
        assert len(steps) >= 8, heading
        for cell in steps:
            assert any(_DOTTED.match(n) for n in _INLINE.findall(cell)), f"{heading}: a step without its function"
    names = sorted({n for n in _INLINE.findall(text) if _DOTTED.match(n)})
    assert len(names) >= 60
    missing = [n for n in names if not _resolves(n)]
    assert missing == [], f"docs/architecture.md names what the code does not have (update the page): {missing}"


def test_the_name_check_catches_a_renamed_function() -> None:
    assert _resolves("modelcache.pull.pull_many") and _resolves("agent.core.Agent.set_spec")
    assert _resolves("modelcache.store.NodeStore.publish")
    assert not _resolves("modelcache.pull.pull_everything")
    assert not _resolves("agent.core.Agent.no_such_method")
    assert not _resolves("modelcache.no_such_module.f")


def _table_modules(text: str) -> set[str]:
    """Module names in the first column of the module tables of ``text`` (``x.py`` or ``x``, one
    or several per cell)."""
    names = set()
    for table in re.findall(r"^\| module \| job \|\n\|[-| ]+\n((?:\|.*\n)+)", text, re.M):
        for line in table.splitlines():
            names |= {n.removesuffix(".py") for n in _INLINE.findall(line.strip("|").split("|")[0])}
    return names


def test_every_module_is_in_a_module_table() -> None:
    """docs/architecture.md lists every module of modelcache/ (and its sub-packages) and
    initializer/, one row each under its package's heading; agent.md and coordinator.md list
    theirs. Nothing listed is missing from the tree."""
    arch = (REPO / "docs" / "architecture.md").read_text()
    sections = dict(re.findall(r"^### `([a-z/]+)/`[^\n]*\n(.*?)(?=^##|\Z)", arch, re.M | re.S))
    where = {p: sections.get(p, "") for p in ("modelcache", "modelcache/sources", "modelcache/kube",
                                              "modelcache/peers", "modelcache/store", "modelcache/runtime",
                                              "modelcache/engine", "modelcache/cli", "initializer")}
    where["agent"] = (REPO / "docs" / "agent.md").read_text()
    where["coordinator"] = (REPO / "docs" / "coordinator.md").read_text()
    packages = {p.parent.relative_to(REPO).as_posix() for root in ("modelcache", "agent", "coordinator", "initializer")
                for p in (REPO / root).rglob("__init__.py")}
    assert sorted(packages) == sorted(where), "a package without a module table"
    for package, text in where.items():
        tree = {p.stem for p in (REPO / package).glob("*.py") if p.name != "__init__.py"}
        listed = _table_modules(text)
        assert sorted(tree - listed) == [], f"{package}: modules without a row"
        assert sorted(listed - tree) == [], f"{package}: rows for modules that do not exist"


#: A module a reviewer reads in one sitting (issue 29: the seams that grew were 900-1,300 lines).
MAX_MODULE_LINES = 700


def test_no_product_module_is_over_700_lines() -> None:
    """Every module of the product (what the wheel and the image ship) stays under MAX_MODULE_LINES:
    past it, split the module by job and give the new one a row in its module table."""
    long = {p.relative_to(REPO).as_posix(): n
            for root in ("modelcache", "agent", "coordinator", "initializer")
            for p in (REPO / root).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_the_readme_is_a_page_read_in_one_sitting() -> None:
    """README.md stays short (≤ 220 lines) and sends each reader on: install, development,
    architecture and benchmarks have their own pages, and no benchmark table comes back."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 220, "README.md is over 220 lines: move the detail to docs/ and link it"
    for page in ("docs/install.md", "docs/development.md", "docs/architecture.md", "docs/benchmarks.md"):
        assert f"]({page})" in text, page
    assert not [ln for ln in text.splitlines() if ln.startswith("|") and "MB/s" in ln]


def test_install_is_told_once() -> None:
    """The install steps (KServe's node label that places the agent) are shown in install.md
    only; the README, deploy/README.md and operations.md link to it."""
    step = "kserve/localmodel=worker"
    shown = [doc.name if doc.parent.name != "deploy" else "deploy/README.md" for doc in DOCS
             if any(step in code for code in _code(doc.read_text()) if "kubectl label" in code)]
    assert shown == ["install.md"]
    assert "](docs/install.md)" in (REPO / "README.md").read_text()
    assert "](../docs/install.md)" in (REPO / "deploy" / "README.md").read_text()
    assert "](install.md#3-install)" in (REPO / "docs" / "operations.md").read_text()


# A path a clone lacks: the notes beside the repository on the machines it was built on.
_OUTSIDE = re.compile(r"\.\./shared/|\bshared/[A-Z][A-Z-]+\.md|\bDESIGN\.md|\b[A-Z]+-REVIEW\.md|"
                      r"KSERVE-" r"CONTRACTS|(?<![\w.])/work/")


def test_nothing_cites_a_file_a_clone_does_not_have() -> None:
    """Docs, docstrings, comments and scripts cite only what a clone holds (or what its set-up
    makes, like .work/); the review notes the code was written against are not in the repository."""
    import subprocess

    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.sh", "*.yaml", "*.toml", "Makefile", "Dockerfile"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    found = [f"{name}:{n}: {m.group(0)}" for name in files if name != "tests/test_docs.py" and (REPO / name).is_file()
             for n, line in enumerate((REPO / name).read_text(errors="replace").splitlines(), 1)
             for m in [_OUTSIDE.search(line)] if m]
    assert found == []


def test_the_docs_index_lists_every_page() -> None:
    """docs/README.md sends each reader to every page of docs/, and names none that is gone."""
    text = (REPO / "docs" / "README.md").read_text()
    listed = set(re.findall(r"\]\(([a-z0-9-]+\.md)\)", text))
    pages = {p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md"}
    assert sorted(pages - listed) == [] and sorted(listed - pages) == []


#: What stands in for a kubelet in a test: an API-only Node, a Ready condition or a pod's status
#: written by the test, a pod no kubelet runs, a deletion the test confirms.
_STAND_IN = re.compile(r'register_node\(|make_node\(kube|set_ready\(|create\(NODES|patch_status\(PODS|grace_period=0'
                       r'|create\(PODS|"kind": "Pod"|kubelet_confirms_pod_deletions')
_REAL_NODES = 'xdist_group("realnodes")'


def _stand_in_problems(section: str, sources: dict[str, str]) -> list[str]:
    """What is wrong with the "API-only Nodes and why" table ``section`` given the test files'
    ``sources`` ({tests/x.py: text}): a file that stands in for a kubelet with no row (or a row
    without a reason), a row for a file that does not (or runs on real nodes), and a `::name` that
    is no test of a real-node file."""
    problems, listed = [], set()
    for row in (ln for ln in section.splitlines() if ln.startswith("| `tests/")):
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        if len(cells) != 3 or not all(cells):
            problems.append(f"a row without its stand-in and reason: {row[:80]}")
            continue
        listed |= set(re.findall(r"`(tests/test_\w+\.py)`", cells[0]))
        for path, name in re.findall(r"(tests/test_\w+\.py)::(\w+)", row):
            text = sources.get(path, "")
            if _REAL_NODES not in text or not re.search(rf"^def {name}\(", text, re.M):
                problems.append(f"{path}::{name} is no test on real nodes")
    using = {path for path, text in sources.items() if _STAND_IN.search(text) and _REAL_NODES not in text}
    problems += [f"{path} stands in for a kubelet and is not listed" for path in sorted(using - listed)]
    problems += [f"{path} is listed but stands in for no kubelet" for path in sorted(listed - using)]
    return problems


def _api_only_section() -> str:
    text = (REPO / "docs" / "test-cluster.md").read_text()
    return text.split("### API-only Nodes and why\n", 1)[1].split("\n#", 1)[0]


def test_every_stand_in_for_a_kubelet_is_listed() -> None:
    """docs/test-cluster.md's "API-only Nodes and why" lists every test file that stands in for a
    kubelet, each with its reason, and the real-node tests it points to exist (issue 24, item 9)."""
    sources = {f"tests/{p.name}": p.read_text() for p in sorted((REPO / "tests").glob("test_*.py"))}
    assert _stand_in_problems(_api_only_section(), sources) == []


def test_the_stand_in_check_catches_an_unlisted_file_and_a_wrong_name() -> None:
    section = ("| Tests | Stand-in | Why |\n|---|---|---|\n"
               "| `tests/test_a.py` | API-only Nodes | scale; real: `tests/test_real.py::test_gone` |\n"
               "| `tests/test_c.py` | nothing |  |\n")
    sources = {"tests/test_a.py": "cluster.register_node('n')", "tests/test_b.py": "set_ready(kube, 'n', False)",
               "tests/test_c.py": "kube.create(PODS, pod)",
               "tests/test_real.py": f"pytestmark = pytest.mark.{_REAL_NODES}\ndef test_here(): register_node('x')"}
    assert _stand_in_problems(section, sources) == [
        "tests/test_real.py::test_gone is no test on real nodes",
        "a row without its stand-in and reason: | `tests/test_c.py` | nothing |  |",
        "tests/test_b.py stands in for a kubelet and is not listed",
        "tests/test_c.py stands in for a kubelet and is not listed"]
    sources["tests/test_real.py"] += "\ndef test_gone(): pass"
    fixed = section.replace("|  |", "| objects are the point |") + "| `tests/test_b.py` | set_ready | speed |\n"
    assert _stand_in_problems(fixed, sources) == []
    del sources["tests/test_b.py"]
    assert _stand_in_problems(fixed, sources) == ["tests/test_b.py is listed but stands in for no kubelet"]
