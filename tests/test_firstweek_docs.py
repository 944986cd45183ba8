"""What a newcomer reads and gets on the first day that is not a program's output (issue 27):
the LICENSE that pyproject names, and install.md's first step and troubleshooting table as the
newcomer review found them wanting (C15, the `MODELS 0` row)."""

from __future__ import annotations

import re
import tomllib

from tests.helpers import REPO


def test_the_license_file_is_the_apache_license_pyproject_names() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190
    # setuptools puts LICENSE* into the wheel by default; nothing in pyproject may say otherwise.
    assert "license-files" not in meta or any("LICENSE" in f for f in meta["license-files"])


def test_install_step_one_needs_no_tool_it_does_not_name_and_says_no_image_is_published() -> None:
    text = (REPO / "docs" / "install.md").read_text()
    step = text[text.index("## 1. The image"):text.index("## 2.")]
    flat = " ".join(step.split())
    assert "No image is published for you" in flat and "ghcr.io/modelcache/modelcache:0.1.0" in flat
    assert "kubectl's built-in kustomize has no `edit`" in flat and "by hand" in flat
    # A failed `kustomize` no longer leaves the reader inside deploy/: the cd is in a subshell.
    assert "(cd deploy && kustomize edit set image" in step and "&& cd .." not in step
    assert "&& cd .." not in (REPO / "README.md").read_text()


def test_the_troubleshooting_table_has_the_rows_the_review_missed() -> None:
    text = (REPO / "docs" / "install.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert any("ImagePullBackOff" in r for r in rows)
    assert not any("MODELS 0" in r for r in rows) and any("`MODELS` blank" in r for r in rows)
    drift = next(r for r in rows if "modelDetails[].drift" in r)
    assert "AWS_ACCESS_KEY_ID" in drift and "no AWS credentials" in drift
    failed = next(r for r in rows if r.startswith("| `FAILED 1`"))
    assert "NoDownloadErrors=False" in failed and "DownloadFailed" in failed
    assert re.search(r"naming the Secret and ServiceAccount", failed)


def test_the_standalone_agents_example_root_is_no_cli_examples_root() -> None:
    """D2: the README's one-machine line pulled into `--root /srv/models` and agent.md's standalone
    example took `--root /srv/models` too, a root the agent then emptied of every model its file did
    not list. The examples now use roots of their own, and the README says the agent owns its root."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    agent_roots, cli_roots = set(), set()
    for doc in docs:
        for line in doc.read_text().splitlines():
            for tool, root in re.findall(r"\b(modelcache-agent|modelcache)\b[^`|]*?--root[ =](\S+)", line):
                (agent_roots if tool == "modelcache-agent" else cli_roots).add(root.strip("`'\""))
    assert agent_roots and cli_roots, (agent_roots, cli_roots)
    assert not agent_roots & cli_roots, agent_roots & cli_roots
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "**it owns its root**: it deletes every model its file does not list" in readme
