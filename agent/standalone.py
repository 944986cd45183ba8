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
import threading
from pathlib import Path
from typing import Any

import yaml

from agent.core import Agent
from agent.logs import fields
from agent.publish import Publisher
from modelcache.clock import rfc3339
from modelcache.errors import ModelcacheError
from modelcache.kube.types import MODEL_DOWNLOADED, LocalModelNode
from modelcache.kube.validate import node_problems

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
    except (OSError, yaml.YAMLError) as exc:
        why = " ".join(str(exc).split())
        raise ModelcacheError(f"{path}: cannot read a LocalModelNode manifest ({type(exc).__name__}: {why})") from None
    for doc in docs:
        if doc.get("kind") == "LocalModelNode":
            problems = node_problems(doc)
            if problems:
                raise InvalidSpecError(path, problems)
            return doc
    kinds = sorted({str(d.get("kind")) for d in docs if d.get("kind")})
    found = f" (found: {', '.join(kinds)})" if kinds else ""
    raise ModelcacheError(f"{path}: no document of kind LocalModelNode in the file{found}")


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
        states = self.agent.status()["modelStatus"]
        ok = all(s == MODEL_DOWNLOADED for s in states.values())
        log.info("standalone run done", extra=fields(status_file=str(self.out), models=len(states), ok=ok))
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
