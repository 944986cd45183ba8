"""Standalone mode, for machines without Kubernetes.

``modelcache-agent --standalone node.yaml --root DIR`` reads a LocalModelNode manifest (the
first document of that kind in the file), checks it as the API server would check it against
the CRD (modelcache.kube.validate: an invalid file is refused whole, each problem on one line,
before anything under the root changes: the agent deletes what the spec does not list, so a
misread spec would cost every model), fills the root as the cluster agent would, and
writes the object with its ``status`` to ``<FILE>.status.yaml`` beside it (the input file is
never modified). Without ``--watch`` it exits once every model is Downloaded or Error (exit
code 0 when all are Downloaded, 1 otherwise); with ``--watch`` it keeps running, re-reads the
file when it changes and retries failed models with backoff; an invalid edit is logged and
reported in the status file, and the last valid spec stays in force.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from agent.core import Agent
from agent.logs import fields
from agent.publish import Publisher
from modelcache.errors import ModelcacheError
from modelcache.kube.types import MODEL_DOWNLOADED, LocalModelNode
from modelcache.kube.validate import node_problems
from modelcache.runtime.clock import rfc3339

log = logging.getLogger("agent.standalone")


def status_path(spec_file: Path) -> Path:
    return spec_file.with_name(spec_file.name + ".status.yaml")


class InvalidSpecError(ModelcacheError):
    """The file's LocalModelNode would not pass the CRD's validation; ``problems``: one line each."""

    reason = "InvalidSpec"

    def __init__(self, path: Path, problems: list[str]) -> None:
        super().__init__(f"{path}: {len(problems)} problem(s) in the LocalModelNode: " + "; ".join(problems))
        self.problems = problems


def read_node(path: Path) -> dict[str, Any]:
    """The file's first LocalModelNode, checked; raises ModelcacheError (InvalidSpecError)."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    except OSError as exc:
        raise ModelcacheError(f"{path}: cannot read a LocalModelNode manifest ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        # Not YAML: as invalid as a wrong field type, and reported the same way (under --watch,
        # the SpecValid=False condition), naming the line and column in the file.
        raise InvalidSpecError(path, [_yaml_problem(exc)]) from None
    for doc in docs:
        if doc.get("kind") == "LocalModelNode":
            problems = node_problems(doc)
            if problems:
                raise InvalidSpecError(path, problems)
            return doc
    kinds = sorted({str(d.get("kind")) for d in docs if d.get("kind")})
    found = f" (found: {', '.join(kinds)})" if kinds else ""
    raise ModelcacheError(f"{path}: no document of kind LocalModelNode in the file{found}")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """``line 4, column 12: expected ',' or '}', but got '<stream end>' (while parsing a flow mapping
    that starts at line 3, column 5)``: where the file stops being YAML, with lines counted from 1."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return "not valid YAML: " + " ".join(str(exc).split())
    mark = exc.problem_mark
    text = f"line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {exc.problem}"
    if exc.context:
        start = exc.context_mark
        where = f" that starts at line {start.line + 1}, column {start.column + 1}" if start is not None else ""
        text += f" ({exc.context}{where})"
    return text


def credential_fields_ignored(obj: dict[str, Any]) -> list[str]:
    """Entries that set ``serviceAccountName`` or ``storage``: without a cluster there is no Secret
    to read them from, so the agent's own environment and ``--download-env`` are used instead."""
    out = []
    for info in LocalModelNode.from_dict(obj).spec.local_models:
        named = [n for n, v in (("serviceAccountName", info.service_account_name), ("storage", info.storage)) if v]
        if named:
            out.append(f"{info.status_key}: {' and '.join(named)}")
    return out


class StandaloneRunner:
    def __init__(self, agent: Agent, spec_file: Path, watch: bool = False, obj: dict[str, Any] | None = None) -> None:
        self.agent, self.spec_file, self.watch = agent, spec_file, watch
        self.out = status_path(spec_file)
        self.obj = obj if obj is not None else read_node(spec_file)
        self.publisher = Publisher(agent, self._write, agent.cfg.status_interval)
        self._mtime = spec_file.stat().st_mtime_ns
        self._stop = threading.Event()
        self._last: dict[str, Any] | None = None

    def _write(self, ours: dict[str, Any]) -> None:
        if ours == self._last:
            return
        self._last = ours
        obj = dict(self.obj)
        obj["status"] = {**ours, "lastUpdated": rfc3339()}
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(yaml.safe_dump(obj, sort_keys=False))
        os.replace(tmp, self.out)

    def _apply(self) -> None:
        lmn = LocalModelNode.from_dict(self.obj)
        for entry in credential_fields_ignored(self.obj):
            log.warning("standalone mode has no cluster to read Secrets from: the entry's credential fields are "
                        "ignored; its credentials come from the agent's environment and --download-env",
                        extra=fields(file=str(self.spec_file), entry=entry))
        self.agent.set_spec(lmn.spec.local_models, lmn.generation or None)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        self._apply()
        self.agent.start()
        self.publisher.start()
        try:
            while not self._stop.wait(0.2):
                if self.watch:
                    self._reload_if_changed()
                elif self.agent.settled():
                    break
        finally:
            self.agent.stop()
            self.publisher.stop()
        status = self.agent.status()
        states = status["modelStatus"]
        ok = all(s == MODEL_DOWNLOADED for s in states.values())
        log.info("standalone run done", extra=fields(status_file=str(self.out), models=len(states), ok=ok))
        if not ok and not self.watch:
            # A one-shot run ends with one line per model that failed (the last log line was a
            # warning with a retry that never comes: a one-shot run does not retry).
            failed = sorted(k for k, s in states.items() if s != MODEL_DOWNLOADED)
            for key in failed:
                detail = status["modelDetails"].get(key) or {}
                print(f"error: {key}: {detail.get('message') or states[key]}", file=sys.stderr, flush=True)
            print(f"error: {len(failed)} of {len(states)} model(s) not downloaded; status in {self.out}; run again, or "
                  "with --watch to retry with backoff", file=sys.stderr, flush=True)
        return 0 if ok else 1

    def _reload_if_changed(self) -> None:
        try:
            mtime = self.spec_file.stat().st_mtime_ns
            if mtime == self._mtime:
                return
            self._mtime = mtime
            self.obj = read_node(self.spec_file)
        except InvalidSpecError as exc:
            # Nothing changes on disk: the last valid spec stays in force, the status says why.
            for problem in exc.problems:
                log.warning("invalid spec file: keeping the last valid spec", extra=fields(
                    file=str(self.spec_file), problem=problem))
            self.agent.refuse_spec(exc.problems)
            return
        except (OSError, ModelcacheError) as exc:
            log.warning("cannot re-read the spec file", extra=fields(error=str(exc)))
            return
        self._apply()
