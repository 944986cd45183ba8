"""ModelScope (``modelscope://``): the test Hub checked with the official client, the URI form,
pulls (revisions, sub-folders, private models), one-line errors, and the backend contract."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from modelcache.errors import InvalidURIError, NotFoundError
from modelcache.pull import pull
from modelcache.sources.base import open_source
from modelcache.sources.credentials import Settings
from modelcache.sources.uri import parse_uri
from tests.contract import NetworkContract, NetworkTarget, first_match, nth_match
from tests.helpers import REPO
from tests.modelscopehub import MSHub, MSRequest
from tests.pull_helpers import error_line, model_files, pull_cmd

TOKEN = "ms-test-token"
FILES = {"config.json": b'{"model_type": "tiny"}', "weights/w.bin": os.urandom(600_000), "tok/vocab.txt": b"a\nb\n"}


def _env(hub: MSHub, **extra: str) -> dict[str, str]:
    return {"MODELSCOPE_ENDPOINT": hub.url, **extra}


def test_the_official_client_downloads_from_the_test_hub(ms_hub: MSHub, modelscope_client: None,
                                                         tmp_path: Path) -> None:
    """The test Hub is ModelScope-shaped: modelscope's own snapshot_download reads it (listing,
    sha256 checks, the redirect to object storage), also for a private model with a token."""
    ms_hub.create_model("org/tiny", FILES)
    ms_hub.create_model("org/secret", {"a.bin": b"private bytes"}, private=True)
    ms_hub.tokens.add(TOKEN)
    code = (
        "import sys\nfrom modelscope import snapshot_download\n"
        "out = snapshot_download(sys.argv[1], revision='master', local_dir=sys.argv[2])\nprint(out)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELSCOPE_")} | {
        "MODELSCOPE_ENDPOINT": ms_hub.url, "MODELSCOPE_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    for model, expected, extra in (("org/tiny", FILES, {}), ("org/secret", {"a.bin": b"private bytes"},
                                                            {"MODELSCOPE_API_TOKEN": TOKEN})):
        out = tmp_path / model.replace("/", "-")
        run = subprocess.run([sys.executable, "-c", code, model, str(out)], env=env | extra, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*")
               if p.is_file() and not p.relative_to(out).as_posix().startswith(".")}
        assert got == expected
    assert any(r.origin == "storage" for r in ms_hub.requests)  # the big file came from object storage


@pytest.mark.parametrize(
    ("uri", "repo", "revision", "sub"),
    [
        ("modelscope://org/tiny", "org/tiny", "master", ""),
        ("modelscope://org/tiny:v1.0", "org/tiny", "v1.0", ""),
        ("modelscope://Qwen/Qwen2.5-0.5B-Instruct:master/onnx/fp16", "Qwen/Qwen2.5-0.5B-Instruct", "master",
         "onnx/fp16"),
    ],
)
def test_uri_form(uri: str, repo: str, revision: str, sub: str) -> None:
    loc = parse_uri(uri)
    assert (loc.kind, loc.repo_id, loc.revision, loc.subfolder) == ("modelscope", repo, revision, sub)  # type: ignore[attr-defined]


@pytest.mark.parametrize("uri", ["modelscope://org", "modelscope://org/tiny:", "modelscope://org/../x",
                                 "modelscope://org/ti ny", "modelscope://org/tiny/../../etc"])
def test_invalid_uris_are_one_line_naming_the_form(uri: str) -> None:
    with pytest.raises(InvalidURIError) as err:
        parse_uri(uri)
    assert "modelscope://owner/model[:revision][/sub/dir]" in str(err.value) and "\n" not in str(err.value)


def test_a_token_in_the_uri_is_refused_naming_the_backends_own_variable() -> None:
    """The hint comes from the backend's module (its Location), not from a table in uri.py."""
    with pytest.raises(InvalidURIError) as err:
        parse_uri("modelscope://me:ms-secret-token@org/tiny")
    msg = str(err.value)
    assert "credentials must not be written into the URI" in msg and "MODELSCOPE_API_TOKEN" in msg
    assert "ms-secret-token" not in msg


def test_pull_a_tag_and_a_sub_folder(ms_hub: MSHub, tmp_path: Path) -> None:
    model = ms_hub.create_model("org/tiny", FILES)
    model.tag("v1.0")
    model.commit({"config.json": b'{"model_type": "newer"}'})  # master moves on; the tag does not
    got = pull("modelscope://org/tiny:v1.0", root=tmp_path / "a", settings=Settings.from_env(_env(ms_hub)))
    assert model_files(tmp_path / "a", "modelscope://org/tiny:v1.0") == FILES
    assert got.resolved_uri == "modelscope://org/tiny:v1.0" and got.verified == ("sha256",)
    pull("modelscope://org/tiny/weights", root=tmp_path / "b", settings=Settings.from_env(_env(ms_hub)))
    assert model_files(tmp_path / "b", "modelscope://org/tiny/weights") == {"w.bin": FILES["weights/w.bin"]}


def test_a_private_model_needs_the_token_and_it_stays_on_the_hub(ms_hub: MSHub, tmp_path: Path) -> None:
    ms_hub.create_model("org/secret", FILES, private=True)
    ms_hub.tokens.add(TOKEN)
    uri = "modelscope://org/secret"
    with pytest.raises(NotFoundError, match="a private model needs MODELSCOPE_API_TOKEN"):
        pull(uri, root=tmp_path / "no", settings=Settings.from_env(_env(ms_hub)))
    pull(uri, root=tmp_path / "yes", settings=Settings.from_env(_env(ms_hub, MODELSCOPE_API_TOKEN=TOKEN)))
    assert model_files(tmp_path / "yes", uri) == FILES
    storage = [r for r in ms_hub.requests if r.origin == "storage"]
    assert storage and all(r.token is None for r in storage)  # never sent to the object storage


def test_an_unknown_revision_is_one_line_naming_the_ones_there_are(ms_hub: MSHub, tmp_path: Path) -> None:
    ms_hub.create_model("org/tiny", FILES)
    uri = "modelscope://org/tiny:v9"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELSCOPE_")} | _env(ms_hub)
    run = subprocess.run(pull_cmd(uri, tmp_path / "root"), env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    error_line(run, uri, "revision 'v9' not found", "it has: master")


def test_the_listing_carries_every_files_sha256(ms_hub: MSHub) -> None:
    ms_hub.create_model("org/tiny", FILES)
    with open_source("modelscope://org/tiny", Settings.from_env(_env(ms_hub))) as src:
        listed = {f.path: f for f in src.list_files()}
    assert {p: f.checksums[0].value for p, f in listed.items()} == {
        p: hashlib.sha256(d).hexdigest() for p, d in FILES.items()}


# ---- the backend contract (tests/contract.py) ------------------------------------------------


class _ModelScopeTarget(NetworkTarget):
    """The test Hub: one model per call; a commit on master is a new version of a file."""

    def __init__(self, hub: MSHub) -> None:
        self.hub = hub
        self.n = 0

    def model(self, files: dict[str, bytes]) -> str:
        self.n += 1
        self.hub.create_model(f"org/m{self.n}", files)
        return f"modelscope://org/m{self.n}"

    def missing(self) -> str:
        return "modelscope://org/nothing-here"

    def env(self) -> dict[str, str]:
        return _env(self.hub)

    def replace(self, uri: str, path: str, data: bytes) -> None:
        self.hub.models[uri.removeprefix("modelscope://")].commit({path: data})

    def _reads(self, uri: str, path: str) -> Callable[[MSRequest], bool]:
        tree = self.hub.models[uri.removeprefix("modelscope://")].revisions["master"]
        sha = tree[path].sha256
        return lambda r: r.method == "GET" and (r.query.get("FilePath") == path or r.path == f"/objects/{sha}")

    def on_read(self, uri: str, path: str, nth: int, action: Callable[[], None]) -> None:
        self.hub.on_request(lambda r: action(), when=nth_match(self._reads(uri, path), nth))

    def fail_read(self, uri: str, path: str, status: int, retry_after: int) -> Callable[[], int]:
        when, hits = first_match(self._reads(uri, path))
        self.hub.fail(status, retry_after=retry_after, when=when)
        return hits

    def flip_read(self, uri: str, path: str) -> Callable[[], int]:
        self.hub.flip_next[self.hub.models[uri.removeprefix("modelscope://")].revisions["master"][path].sha256] = 1
        return lambda: self.hub.flipped

    def throttle(self, bytes_per_s: int | None) -> None:
        self.hub.throttle_bps = bytes_per_s

    def sent(self) -> int:
        return self.hub.body_bytes_sent


class TestModelScopeContract(NetworkContract):
    @pytest.fixture
    def target(self, ms_hub: MSHub) -> _ModelScopeTarget:
        return _ModelScopeTarget(ms_hub)
