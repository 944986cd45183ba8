"""``pull_many`` as a pipeline over one ``PullRequest``: a model's ``Exception`` is its own, while
``KeyboardInterrupt`` and ``SystemExit`` end the whole pull at once (locks released, what was
staged kept for a resume); the request's fields may be given by name or as one object."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelcache.engine.transfer import TransferOptions
from modelcache.pull import PullPlan, PullRequest, PullResult, pull, pull_many
from modelcache.sources.credentials import Settings
from modelcache.sources.uri import parse_uri
from modelcache.store import NodeStore

OPTIONS = TransferOptions(workers=2, chunk_size=16 << 10, direct_io=False, max_attempts=1)


def _sources(tmp_path: Path, n: int = 2) -> list[str]:
    uris = []
    for i in range(n):
        src = tmp_path / f"src{i}"
        (src / "sub").mkdir(parents=True)
        (src / "a.bin").write_bytes(os.urandom(40_000 + i))
        (src / "sub" / "b.json").write_bytes(b"{}")
        uris.append(str(src))
    return uris


def _request(root: Path, **fields: object) -> PullRequest:
    return PullRequest(root=root, options=OPTIONS, settings=Settings.from_env({}), **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), SystemExit(3)], ids=["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_in_a_hook_ends_the_whole_pull(tmp_path: Path, stop: BaseException) -> None:
    uris = _sources(tmp_path)
    root = tmp_path / "root"
    first = parse_uri(uris[0]).storage_key
    asked: list[str] = []

    def admit(plan: PullPlan) -> None:
        asked.append(plan.storage_key)
        raise stop

    with pytest.raises(type(stop)) as caught:
        pull_many(uris, _request(root, admit=admit))
    assert caught.value is stop  # the very exception, never wrapped or renamed
    assert asked == [first]  # the second model's pipeline never ran: the pull ended at once
    store = NodeStore.at(root)
    assert not any(store.is_present(parse_uri(u).storage_key) for u in uris)
    # What the first model staged is kept for a resume, not settled as a failure.
    assert [(s.storage_key, s.failure) for s in store.staged()] == [(first, "")]
    # Its locks were released: the next pull of both gets them and finishes.
    again = pull_many(uris, _request(root))
    assert all(isinstance(r, PullResult) and not r.cached for r in again), again


def test_an_exception_is_its_models_own(tmp_path: Path) -> None:
    uris = _sources(tmp_path)
    root = tmp_path / "root"
    first = parse_uri(uris[0]).storage_key

    def admit(plan: PullPlan) -> None:
        if plan.storage_key == first:
            raise ValueError("refused by the hook")

    results = pull_many(uris, _request(root, admit=admit))
    assert isinstance(results[0], ValueError) and str(results[0]) == "refused by the hook"
    assert isinstance(results[1], PullResult) and results[1].files == 2
    with pytest.raises(ValueError, match="refused by the hook"):
        pull(uris[0], _request(root, admit=admit))


def test_the_request_by_name_or_as_one_object(tmp_path: Path) -> None:
    uris = _sources(tmp_path, 1)
    root = tmp_path / "root"
    by_name = pull(uris[0], root=root, options=OPTIONS, settings=Settings.from_env({}))
    assert not by_name.cached
    as_object = pull(uris[0], _request(root))
    assert as_object.cached and as_object.path == by_name.path
    # A field given by name overrides the request's (here: where the model goes).
    other = pull(uris[0], _request(root), root=tmp_path / "other")
    assert not other.cached and other.path.is_relative_to(tmp_path / "other")
    with pytest.raises(TypeError):
        pull(uris[0], _request(root), no_such_field=1)

