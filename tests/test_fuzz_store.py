"""Property-based tests of what the store reads back from disk: the resume journal and manifests.

Any byte string on disk is rejected or recovered, never trusted:
- a damaged journal makes the pull fetch the damaged pieces again, never publish wrong bytes:
  the staged files hold garbage wherever the honest journal says nothing has landed, and the
  source (a local folder) has no checksum that would catch a lie later;
- a damaged manifest is absent (the model is fetched again) or reads back exactly as written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from modelcache.engine.transfer import TransferOptions
from modelcache.pull import _list, _Model, _prepare_staging, pull
from modelcache.sources.credentials import Settings
from modelcache.sources.integrity import hash_file
from modelcache.sources.uri import parse_uri
from modelcache.store import NodeLayout, NodeStore
from modelcache.store.journal import Journal
from tests.fuzzing import examples, mutate, mutation

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(600)]

CHUNK = 16 << 10
SIZES = {"a.bin": 5 * CHUNK + 100, "sub/b.bin": 3 * CHUNK, "c.json": 50}
OPTIONS = TransferOptions(workers=2, chunk_size=CHUNK, direct_io=False, max_attempts=1, sync_interval=60)

# -- the journal ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """A source folder, and a store whose staging area is what a killed pull leaves behind: an
    honest journal (some chunks done, one file finished) and, in the staged files, the right
    bytes where it says so and garbage everywhere else."""
    base = tmp_path_factory.mktemp("fuzz-journal")
    src = base / "src"
    for rel, size in SIZES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(os.urandom(size))
    uri, root = str(src), base / "template"
    loc = parse_uri(uri)
    m = _Model(loc, NodeStore(NodeLayout(root)), loc.storage_key)
    _list(m, Settings.from_env({}))
    _prepare_staging(m, CHUNK)
    assert m.journal is not None
    data = root / ".modelcache" / "staging" / loc.storage_key / "data"
    for i, f in enumerate(m.files):
        true = (src / f.path).read_bytes()
        staged_bytes = bytearray(os.urandom(len(true)))
        finished = f.path == "c.json"
        for c, start in enumerate(range(0, len(true), CHUNK)):
            if finished or (i + c) % 2 == 0:
                end = min(start + CHUNK, len(true))
                staged_bytes[start:end] = true[start:end]
                m.journal.chunk(i, c, end - start)
        (data / f.path).parent.mkdir(parents=True, exist_ok=True)
        (data / f.path).write_bytes(bytes(staged_bytes))
        if finished:
            m.journal.file_done(i, hash_file(src / f.path).local_hexdigest(), ())
    m.journal.synced()
    m.journal.close()
    return uri, src, root


def _pull_with_journal(uri: str, src: Path, template: Path, journal_bytes: bytes | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        shutil.copytree(template, root)
        key = parse_uri(uri).storage_key
        journal = root / ".modelcache" / "staging" / key / "journal"
        if journal_bytes is not None:
            journal.write_bytes(journal_bytes)
        pull(uri, root=root, options=OPTIONS, settings=Settings.from_env({}))
        folder = root / "models" / key
        for rel in SIZES:
            assert (folder / rel).read_bytes() == (src / rel).read_bytes(), f"{rel}: wrong bytes published"
        assert NodeStore.at(root).verify(key) == []


def test_the_honest_journal_resumes(staged: tuple[str, Path, Path]) -> None:
    uri, src, template = staged
    key = parse_uri(uri).storage_key
    state = Journal(str(template / ".modelcache" / "staging" / key / "journal")).load()
    assert state.chunks and state.files  # the fixture really leaves something to resume
    _pull_with_journal(uri, src, template, None)


@hsettings(max_examples=examples(60))
@given(st.lists(mutation, min_size=1, max_size=4))
def test_a_damaged_journal_never_publishes_wrong_bytes(staged: tuple[str, Path, Path], ops: list[tuple]) -> None:
    uri, src, template = staged
    journal = template / ".modelcache" / "staging" / parse_uri(uri).storage_key / "journal"
    _pull_with_journal(uri, src, template, mutate(journal.read_bytes(), ops))


@hsettings(max_examples=examples(300))
@given(st.binary(max_size=400))
def test_any_bytes_as_a_journal_load_without_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal"
        path.write_bytes(data)
        state = Journal(str(path)).load()
        assert state.chunks == {} and state.files == {}  # nothing unsealed is believed


# -- manifests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[NodeStore, str, bytes]:
    base = tmp_path_factory.mktemp("fuzz-manifest")
    src = base / "src"
    for rel, size in SIZES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(os.urandom(size))
    result = pull(str(src), root=base / "root", options=OPTIONS, settings=Settings.from_env({}))
    store = NodeStore.at(base / "root")
    return store, result.storage_key, store.layout.manifest_path(result.storage_key).read_bytes()


def _read_back(store: NodeStore, key: str, raw: bytes) -> None:
    path = store.layout.manifest_path(key)
    original = path.read_bytes()
    try:
        path.write_bytes(raw)
        m = store.manifest(key)
        present = store.is_present(key)
        problems = store.verify(key)
        store.entries()
    finally:
        path.write_bytes(original)
    good = store.manifest(key)
    assert m is None or m == good, "a damaged manifest was read as something else"
    assert present == (m is not None) and (problems == []) == (m is not None)


@hsettings(max_examples=examples(300))
@given(st.lists(mutation, min_size=1, max_size=3))
def test_a_damaged_manifest_is_absent_or_unchanged(published: tuple[NodeStore, str, bytes], ops: list[tuple]) -> None:
    store, key, raw = published
    _read_back(store, key, mutate(raw, ops))


@hsettings(max_examples=examples(200))
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_any_bytes_as_a_manifest_are_rejected(published: tuple[NodeStore, str, bytes], data: bytes) -> None:
    store, key, _raw = published
    _read_back(store, key, data)
