"""``python -m <module> ARGS`` as a process of its own, forked from an interpreter that has the
product imported already, instead of a new interpreter that imports it all again.

Why: a new interpreter spends most of a short run importing. Measured here (2026-12-02, load
10-14): an agent or coordinator that stops at a bad flag or kubeconfig took ~2 CPU-s (the
Kubernetes client's ~850 model modules, prometheus_client, cryptography), the CLI ~0.3; the 44
start-up error tests alone took 70 CPU-s. A child forked from a zygote that imported those once
takes a few hundredths of a second.

The zygote (``python -m tests.forked``) is a fresh interpreter, not the test process (no pytest
hooks, log handlers or warning capture; one thread), that imports ``PRELOAD`` once per test
worker and forks a child for each run (multiprocessing's fork server would import the test
runner's ``__main__`` into every child). What the child keeps as a new process has it: its own
pid, exit status (``sys.exit``'s code; 1 and the traceback on stderr for an uncaught exception; a
signal's negative number), stdout and stderr (files read back here), stdin from /dev/null, the
environment and working directory given, ``sys.argv``, the module run as ``__main__``, non-daemon
threads waited for and logging flushed at exit as the interpreter does. What differs: the modules
in ``PRELOAD`` ran their import-time code in the zygote. No product module reads the environment
at import (modelcache/sources/credentials.py reads it, at call time); the Kubernetes client
reads ``KUBECONFIG`` at import, so the child sets that default again from its own environment,
and ``tempfile`` caches the temp dir on first use, so the child forgets the zygote's (``TMPDIR``).

A program that must be killed at a chosen point (tests/crashpoints.py) or talked to while it
runs stays a real ``subprocess``: this is for runs to completion.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

_REPO = Path(__file__).resolve().parent.parent
#: Imported once in the zygote: every module of the agent and the coordinator (their
#: ``__main__`` too, which each child then runs afresh as ``-m`` does), the CLI, the crash-point
#: runner and the clients they import.
PRELOAD = ["kubernetes.client", "kubernetes.config", "prometheus_client", "modelcache.cli.commands",
           "tests.crashpoints",
           *sorted(f"{pkg}.{p.stem}" for pkg in ("agent", "coordinator") for p in (_REPO / pkg).glob("*.py")
                   if p.stem != "__init__")]


class _Zygote:
    """The test process's end: one request line out per run, a ``started`` and an ``exited``
    line back (by request id), read by one thread that wakes the caller."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forked"], cwd=_REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lock = threading.Lock()
        self.replies: dict[int, dict[str, Any]] = {}
        self.done: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}
        self.next_id = 0
        threading.Thread(target=self._read, name="forked-zygote", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                self.replies.setdefault(msg["id"], {}).update(msg)
                event = (self.started if msg["what"] == "started" else self.done).get(msg["id"])
            if event is not None:
                event.set()
        with self.lock:  # the zygote is gone: wake every caller (they see no exit status)
            for event in (*self.started.values(), *self.done.values()):
                event.set()

    def run(self, request: dict[str, Any], timeout: float) -> tuple[int, int | None]:
        """(pid, exit status as ``Popen.returncode`` has it; None on timeout: the child is killed)."""
        with self.lock:
            rid = self.next_id = self.next_id + 1
            started = self.started[rid] = threading.Event()
            done = self.done[rid] = threading.Event()
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"id": rid, **request}) + "\n")
            self.proc.stdin.flush()
        pid = None
        try:
            started.wait(30)
            pid = self.replies.get(rid, {}).get("pid")
            if pid is None:
                raise RuntimeError(f"the test zygote (tests/forked.py) did not start {request['module']}")
            if not done.wait(timeout):
                os.kill(pid, signal.SIGKILL)
                done.wait(30)
                return pid, None
            reply = self.replies.get(rid, {})
            if "code" not in reply:
                raise RuntimeError(f"the test zygote (tests/forked.py) ended before {request['module']} did")
            return pid, int(reply["code"])
        except BaseException:  # the test's own timeout, Ctrl-C: the child goes too, as subprocess.run does
            if pid is not None and not done.is_set():
                os.kill(pid, signal.SIGKILL)
            raise
        finally:
            with self.lock:
                self.replies.pop(rid, None)
                self.started.pop(rid, None)
                self.done.pop(rid, None)


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _the_zygote() -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = _Zygote()
        return _zygote


def run_module(module: str, *args: str, env: Mapping[str, str] | None = None, cwd: Path | str | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
    env=env, cwd=cwd, timeout=timeout)`` returns, from a forked child (raises ``TimeoutExpired`` the same)."""
    argv = [sys.executable, "-m", module, *args]
    full_env = dict(os.environ if env is None else env)
    if full_env.get("PYTHONPATH") != os.environ.get("PYTHONPATH"):
        raise ValueError(f"{module}: the zygote's sys.path is this process's; run a new PYTHONPATH with subprocess")
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = {"module": module, "args": list(args), "env": full_env,
                   "cwd": str(cwd if cwd is not None else os.getcwd()), "out": str(out), "err": str(err)}
        _pid, code = _the_zygote().run(request, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(argv, timeout, _text(out), _text(err))
        return subprocess.CompletedProcess(argv, code, _text(out), _text(err))


def _text(path: Path) -> str:
    """As ``text=True`` reads a pipe: the locale's encoding, universal newlines."""
    data = path.read_bytes() if path.exists() else b""
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")


# ---- the zygote's side -----------------------------------------------------------------------


def _serve(requests: IO[str], replies: IO[str]) -> None:
    """Fork a child per request line; report each child's pid, then its exit status. One thread:
    the children are forked from a process with no other thread that could hold a lock."""
    children: dict[int, int] = {}  # pid -> request id
    fd = requests.fileno()
    buffered = b""
    open_ = True
    while open_ or children:
        if open_ and select.select([fd], [], [], 0.02)[0]:
            chunk = os.read(fd, 1 << 16)
            open_ = bool(chunk)
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)  # never returns
                children[pid] = request["id"]
                _reply(replies, {"id": request["id"], "what": "started", "pid": pid})
        elif not open_:
            select.select([], [], [], 0.02)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rid = children.pop(pid, None)
            if rid is not None:
                _reply(replies, {"id": rid, "what": "exited", "code": os.waitstatus_to_exitcode(status)})


def _reply(replies: IO[str], msg: dict[str, Any]) -> None:
    replies.write(json.dumps(msg) + "\n")
    replies.flush()


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m module args`` and exit as it would. Never returns."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        # The interpreter's own: stdout block-buffered, stderr line-buffered with backslashreplace.
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                      errors="backslashreplace", line_buffering=True)
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # ``-m`` puts the working directory first
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # read from TMPDIR again on first use, as a new interpreter would
        kube_config = sys.modules.get("kubernetes.config.kube_config")
        if kube_config is not None:  # the client reads it from the environment when imported
            kube_config.KUBE_CONFIG_DEFAULT_LOCATION = os.environ.get("KUBECONFIG", "~/.kube/config")
        code = _run_as_main(request["module"], request["args"])
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)  # as the interpreter exits: sys.exit(-1) is 255


def _run_as_main(module: str, args: list[str]) -> int:
    import logging
    import runpy
    import traceback

    sys.argv = [module, *args]
    sys.modules.pop(f"{module}.__main__", None)  # run afresh, as ``-m`` does
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as the interpreter exits on an uncaught Ctrl-C
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does at exit: wait for non-daemon threads, then flush the log handlers.
    threading._shutdown()  # type: ignore[attr-defined]
    logging.shutdown()
    return code


def main() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    _serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
