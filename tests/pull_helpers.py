"""Shared by the pull fault and crash tests: run the CLI, check what the store shows."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from modelcache.sources.uri import storage_key
from tests import forked
from tests.helpers import REPO

MiB = 1 << 20


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cli_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "modelcache"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "modelcache"]


def run_cli(*args: str, env: Mapping[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``modelcache ARGS`` run to its end, forked with the product imported (tests/forked.py)."""
    return forked.run_module("modelcache", *args, env={**os.environ, **(env or {})}, timeout=timeout, cwd=REPO)


def popen_cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen([*cli_cmd(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=REPO)


def model_dir(root: Path, uri: str) -> Path:
    return root / "models" / storage_key(uri)


def store_contents(root: Path) -> dict[str, dict[str, bytes]]:
    """Every file under ``root/models``: {storage key: {relative path: bytes}}."""
    out: dict[str, dict[str, bytes]] = {}
    models = root / "models"
    if not models.exists():
        return out
    for d in sorted(models.iterdir()):
        files = {}
        for p in sorted(d.rglob("*")):
            if p.is_file():
                files[p.relative_to(d).as_posix()] = p.read_bytes()
        out[d.name] = files
    return out


def assert_store_correct(
    root: Path, expected: Mapping[str, Mapping[str, bytes]], must_have: set[str] = frozenset()
) -> None:
    """Whatever ``models/`` shows is a complete, correct model of an expected URI; ``must_have`` URIs are there.

    ``expected`` maps a URI to its files ({relative path: bytes}).
    """
    by_key = {storage_key(uri): (uri, files) for uri, files in expected.items()}
    seen = store_contents(root)
    for key, files in seen.items():
        assert key in by_key, f"unexpected entry models/{key}: {sorted(files)}"
        uri, want = by_key[key]
        assert set(files) == set(want), f"{uri}: files {sorted(files)} != {sorted(want)}"
        for rel, data in files.items():
            assert len(data) == len(want[rel]) and sha256(data) == sha256(want[rel]), f"{uri}: {rel} differs"
    for uri in must_have:
        assert storage_key(uri) in seen, f"{uri} is not in the store"


def one_error_line(stderr: str) -> str:
    """The CLI's failure report: exactly one non-empty line on stderr, returned."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {stderr!r}"
    return lines[0]


@dataclass
class StoreWatcher:
    """Polls ``root/models`` while a pull runs; records any moment it showed a partial or wrong model.

    A model folder is hashed the first time it is seen (and its listing re-checked on every poll),
    so a folder that appears before its bytes are complete cannot slip through.
    """

    root: Path
    expected: Mapping[str, Mapping[str, bytes]]
    interval: float = 0.002
    problems: list[str] = field(default_factory=list)
    polls: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _verified: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._want = {storage_key(u): {p: (len(b), sha256(b)) for p, b in f.items()} for u, f in self.expected.items()}

    def _check_once(self) -> None:
        models = self.root / "models"
        try:
            keys = [p.name for p in models.iterdir()]
        except FileNotFoundError:
            return
        for key in keys:
            if key not in self._want:
                self.problems.append(f"unexpected models/{key}")
                continue
            d = models / key
            try:
                listing = {p.relative_to(d).as_posix(): p for p in d.rglob("*") if p.is_file()}
            except FileNotFoundError:
                continue  # removed between listdir and walk
            want = self._want[key]
            if set(listing) != set(want):
                self.problems.append(f"models/{key} showed files {sorted(listing)}, expected {sorted(want)}")
                continue
            if key in self._verified:
                continue
            for rel, p in listing.items():
                data = p.read_bytes()
                if (len(data), sha256(data)) != want[rel]:
                    self.problems.append(f"models/{key}/{rel} was visible with wrong or partial content")
            self._verified.add(key)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.polls += 1
            try:
                self._check_once()
            except OSError as exc:
                self.problems.append(f"poll failed: {exc!r}")
            self._stop.wait(self.interval)

    def __enter__(self) -> StoreWatcher:
        self._thread = threading.Thread(target=self._run, name="store-watcher", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=10)
        self._check_once()


def journaled_bytes(root: Path, uri: str) -> int:
    """Bytes the engine's resume journal says are on disk for ``uri`` (max per chunk, summed).

    Crash tests wait on this rather than on what a server sent: on a loaded machine loopback
    socket buffers can hold megabytes that never reached the client's disk.
    """
    from modelcache.store.journal import Journal

    journal = Path(root) / ".modelcache" / "staging" / storage_key(uri) / "journal"
    return sum(Journal(str(journal)).load().chunks.values())


def pull_cmd(uri: str, root: Path, *args: str) -> list[str]:
    """``modelcache pull URI --root ROOT`` without progress output, for subprocess tests."""
    return [sys.executable, "-m", "modelcache", "pull", uri, "--root", str(root), "--progress", "none", *args]


def run_pull(uri: str, root: Path, *args: str, env: Mapping[str, str], timeout: float = 120
             ) -> subprocess.CompletedProcess[str]:
    """``pull_cmd`` run to its end in ``env``, forked with the product imported (tests/forked.py)."""
    return forked.run_module(*pull_cmd(uri, root, *args)[2:], env=env, timeout=timeout, cwd=REPO)


def model_files(root: Path, uri: str) -> dict[str, bytes]:
    """Every file of the published model, by model-relative path."""
    base = model_dir(root, uri)
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()}


def manifest_of(root: Path, uri: str) -> dict[str, object]:
    return json.loads((root / ".modelcache" / "manifests" / f"{storage_key(uri)}.json").read_text())


def error_line(proc: subprocess.CompletedProcess[str], *needles: str, secrets: tuple[str, ...] = ()) -> str:
    """A failed pull reports exactly one ``error:`` line, with every needle, no traceback, no secret."""
    assert proc.returncode != 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for s in secrets:
        assert s not in proc.stderr, "a secret reached stderr"
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]
