"""End to end: `modelcache pull oci://... --root DIR` as a subprocess against the Debian
distribution registry (through the fault proxy where a test needs to slow or count bytes)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from tests.contract import NetworkContract, ProxyTarget
from tests.faultproxy import FaultProxy
from tests.fixtures.oci import LAYER_TAR, LAYER_TGZ, OCIRegistry, docker_config, make_tar
from tests.helpers import REPO, wait_until
from tests.pull_helpers import error_line, manifest_of, model_files, pull_cmd, run_pull, sha256
from tests.test_oci_source import push_artifact

BIG = os.urandom(900_000)  # ~14 chunks at 64K
FILES = {"config.json": b'{"model_type": "tiny"}', "weights/part-0/model.safetensors": BIG, "tok/vocab.txt": b"v" * 999}


@pytest.fixture
def proxy(oci_registry: OCIRegistry) -> Iterator[FaultProxy]:
    host, port = oci_registry.host.split(":")
    p = FaultProxy((host, int(port)))
    try:
        yield p
    finally:
        p.close()


def _env(tmp_path: Path, config: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KSERVE_OCI_", "STORAGE_"))}
    env.update(
        KSERVE_OCI_INSECURE_REGISTRY="true",
        KSERVE_OCI_DOCKER_CONFIG=str(config or tmp_path / "no-config.json"),
        HOME=str(tmp_path),  # no ~/.docker/config.json of the machine
        **extra,
    )
    return env




def _pull(
    tmp_path: Path, uri: str, *args: str, config: Path | None = None, **extra: str
) -> subprocess.CompletedProcess:
    return run_pull(uri, tmp_path / "root", "--chunk-size", "64K", *args, env=_env(tmp_path, config, **extra))


def _model(tmp_path: Path, uri: str) -> dict[str, bytes]:
    return model_files(tmp_path / "root", uri)


def _manifest(tmp_path: Path, uri: str) -> dict:
    return manifest_of(tmp_path / "root", uri)


def _error_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    return error_line(proc, *needles, secrets=())


def test_pull_artifact_nested_multichunk(oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    ref = f"{oci_registry.host}/{oci_repo}:v1"
    push_artifact(oci_registry, ref, tmp_path / "push", FILES)
    uri = f"oci://{ref}"
    proc = _pull(tmp_path, uri)
    assert proc.returncode == 0, proc.stderr
    assert _model(tmp_path, uri) == FILES
    manifest = _manifest(tmp_path, uri)
    assert manifest["resolved_uri"].startswith(f"oci://{oci_registry.host}/{oci_repo}@sha256:")
    checks = {f["path"]: f["checksums"] for f in manifest["files"]}
    assert checks["weights/part-0/model.safetensors"] == {"sha256": hashlib.sha256(BIG).hexdigest()}
    again = _pull(tmp_path, uri)
    assert again.returncode == 0 and "cached" in again.stderr, again.stderr


def test_pull_modelcar_image(oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    base = make_tar([("usr/bin/tool", b"t"), *[(f"models/{k}", v) for k, v in FILES.items()]], gzip_it=True)
    top = make_tar([("models/.wh.config.json", b""), ("models/config.json", b'{"v": 2}')])
    oci_registry.push_image(oci_repo, "v1", [(base, LAYER_TGZ), (top, LAYER_TAR)])
    uri = f"oci+fetch://{oci_registry.host}/{oci_repo}:v1"
    # KServe does not apply STORAGE_ALLOW/IGNORE_PATTERNS to OCI: the whole /models tree comes.
    proc = _pull(tmp_path, uri, STORAGE_ALLOW_PATTERNS='["*.json"]', STORAGE_IGNORE_PATTERNS="*")
    assert proc.returncode == 0, proc.stderr
    assert _model(tmp_path, uri) == {**FILES, "config.json": b'{"v": 2}'}
    assert "@sha256:" in _manifest(tmp_path, uri)["resolved_uri"]


def test_corrupted_byte_fails_verification(oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    ref = f"{oci_registry.host}/{oci_repo}:v1"
    push_artifact(oci_registry, ref, tmp_path / "push", FILES)
    blob = oci_registry.blob_path("sha256:" + hashlib.sha256(BIG).hexdigest())
    data = bytearray(blob.read_bytes())
    data[700_000] ^= 0x01
    blob.write_bytes(bytes(data))
    uri = f"oci://{ref}"
    proc = _pull(tmp_path, uri)
    _error_line(proc, "model.safetensors", "sha256")
    assert not (tmp_path / "root/models" / storage_key(uri)).exists()


def test_tag_moved_during_pull_yields_one_digest(
    oci_registry: OCIRegistry, oci_repo: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    v1 = {"model.bin": os.urandom(1 << 20), "config.json": b"v1"}
    v2 = {"model.bin": os.urandom(1 << 20), "config.json": b"v2"}
    push_artifact(oci_registry, f"{oci_registry.host}/{oci_repo}:main", tmp_path / "a", v1)
    uri = f"oci://127.0.0.1:{proxy.port}/{oci_repo}:main"
    proxy.set_rate_limit(600_000)
    proc = subprocess.Popen(
        pull_cmd(uri, tmp_path / "root", "--chunk-size", "64K", "--workers", "2"),
        env=_env(tmp_path),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: proxy.total_bytes_sent > 200_000, timeout=60, what="pull under way")
        push_artifact(oci_registry, f"{oci_registry.host}/{oci_repo}:main", tmp_path / "b", v2)  # the tag moves
        proxy.set_rate_limit(None)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    got = _model(tmp_path, uri)
    # Compare digests: a failing `==` on megabytes makes pytest diff them for minutes.
    assert {k: sha256(v) for k, v in got.items()} == {k: sha256(v) for k, v in v1.items()}
    resolved = _manifest(tmp_path, uri)["resolved_uri"]
    pinned = _pull(tmp_path / "again", resolved.replace(oci_registry.host, f"127.0.0.1:{proxy.port}"))
    assert pinned.returncode == 0, pinned.stderr


@pytest.mark.parametrize(
    "entry, needle",
    [
        (("models/../../../tmp/slip.txt", b"x"), "escapes the model folder"),
        (("models/evil", "->", "/etc/passwd"), "points outside"),
        (("models/up", "->", "../../.."), "points outside"),
    ],
)
def test_archive_escape_is_refused(
    oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path, entry: tuple, needle: str
) -> None:
    oci_registry.push_image(oci_repo, "evil", [(make_tar([("models/ok.txt", b"ok"), entry]), LAYER_TAR)])
    uri = f"oci://{oci_registry.host}/{oci_repo}:evil"
    _error_line(_pull(tmp_path, uri), uri, needle, "refused")
    assert not (tmp_path / "root/models" / storage_key(uri)).exists()
    # What was unpacked before the bad entry is not left in staging (it cannot be resumed).
    staging = tmp_path / "root/.modelcache/staging" / storage_key(uri)
    assert not [p for p in staging.rglob("*") if p.is_file()], sorted(staging.rglob("*"))


def test_error_messages(
    oci_registry: OCIRegistry, oci_auth_registry: OCIRegistry, oci_repo: str, tmp_path: Path
) -> None:
    host = oci_registry.host
    oci_registry.push_image(oci_repo, "nomodels", [(make_tar([("app/main.py", b"print()")]), LAYER_TAR)])
    oci_registry.push_image(oci_repo, "odd", [(b"\x00" * 8, "application/vnd.example.weights")])
    _error_line(
        _pull(tmp_path, f"oci://{host}/{oci_repo}:nope"), f"oci://{host}/{oci_repo}:nope", "tag 'nope' not found"
    )
    nomodels, odd = f"oci://{host}/{oci_repo}:nomodels", f"oci://{host}/{oci_repo}:odd"
    _error_line(_pull(tmp_path, nomodels), nomodels, "has no /models/ directory")
    _error_line(_pull(tmp_path, odd), odd, "media type 'application/vnd.example.weights'")
    auth = oci_auth_registry
    assert auth.auth is not None
    auth.push_image(oci_repo, "v1", [(make_tar([("models/a.txt", b"a")]), LAYER_TAR)])
    uri = f"oci://{auth.host}/{oci_repo}:v1"
    line = _error_line(_pull(tmp_path, uri), uri, "unauthorized", "KSERVE_OCI_DOCKER_CONFIG")
    assert auth.auth[1] not in line
    ok = _pull(tmp_path, uri, config=docker_config(tmp_path / "cfg.json", auth.host, *auth.auth))
    assert ok.returncode == 0, ok.stderr
    assert auth.auth[1] not in ok.stderr


def test_modelcar_kill_9_then_pull_again(
    oci_registry: OCIRegistry, oci_repo: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Modelcar layers are unpacked as they stream, so a pull killed mid-layer does not resume:
    the next pull unpacks again. Safe: nothing is published half, the stale extraction is
    discarded, and the staging area is gone once the model is published."""
    files = {"a/w.bin": os.urandom(3 << 20), "config.json": b"{}"}
    layer = make_tar([(f"models/{k}", v) for k, v in files.items()])
    oci_registry.push_image(oci_repo, "car", [(layer, LAYER_TAR)])
    uri = f"oci://127.0.0.1:{proxy.port}/{oci_repo}:car"
    key = storage_key(uri)
    root = tmp_path / "root"
    staging = root / ".modelcache/staging" / key
    proxy.set_rate_limit(1_000_000)
    proc = subprocess.Popen(
        pull_cmd(uri, root), env=_env(tmp_path), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    def unpacked() -> int:
        return sum(p.stat().st_size for p in staging.rglob("*") if p.is_file() and "extract" in p.parts)

    try:
        wait_until(lambda: unpacked() > (512 << 10), timeout=60, what="half a MiB unpacked")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert not (root / "models" / key).exists()
    assert not (root / ".modelcache/manifests" / f"{key}.json").exists()
    proxy.set_rate_limit(None)
    done = _pull(tmp_path, uri)
    assert done.returncode == 0, done.stderr
    assert _model(tmp_path, uri) == files
    assert not staging.exists(), sorted(str(p) for p in staging.rglob("*"))



def test_rate_limited_manifest_is_waited_out(
    oci_registry: OCIRegistry, oci_repo: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """429 + Retry-After on the manifest (Docker Hub's pull limit): the pull waits, then succeeds;
    a persistent one fails with one line naming the URI."""
    import time

    from tests.faultproxy import Fault

    oci_registry.push_image(oci_repo, "v1", [(make_tar([("models/a.txt", b"a")]), LAYER_TAR)])
    uri = f"oci://127.0.0.1:{proxy.port}/{oci_repo}:v1"
    path = f"/v2/{oci_repo}/manifests/v1"
    proxy.add(Fault("status", path=path, status=429, retry_after=1, times=2))
    started = time.monotonic()
    proc = _pull(tmp_path, uri)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started >= 2 and _model(tmp_path, uri) == {"a.txt": b"a"}
    proxy.add(Fault("status", path=f"/v2/{oci_repo}/manifests/v2", status=429, retry_after=0, times=None))
    bad = f"oci://127.0.0.1:{proxy.port}/{oci_repo}:v2"
    _error_line(_pull(tmp_path, bad), bad, "HTTP 429", "tag 'v2'")


def test_cancel_stops_a_modelcar_extraction(
    oci_registry: OCIRegistry, oci_repo: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Cancelling a pull (the agent: entry removed, or SIGTERM) stops an OCI modelcar extraction
    at its next read, as it stops the transfer engine: the rest of the image is not fetched."""
    import threading

    from modelcache.errors import CancelledError
    from modelcache.pull import pull
    from modelcache.sources.credentials import Settings

    layer = make_tar([("models/w.bin", os.urandom(3 << 20)), ("models/config.json", b"{}")])
    oci_registry.push_image(oci_repo, "car", [(layer, LAYER_TAR)])
    uri = f"oci://127.0.0.1:{proxy.port}/{oci_repo}:car"
    root = tmp_path / "root"
    staging = root / ".modelcache/staging" / storage_key(uri)
    proxy.set_rate_limit(500_000)  # ~6 s for the layer
    cancel = threading.Event()
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(pull(uri, root=root, settings=Settings.from_env(_env(tmp_path)), cancel=cancel))
        except BaseException as exc:
            outcome.append(exc)

    puller = threading.Thread(target=run)
    puller.start()
    wait_until(lambda: any(p.is_file() and p.stat().st_size > (256 << 10) for p in staging.rglob("*")),
               timeout=60, what="extraction under way")
    cancel.set()
    puller.join(60)
    assert not puller.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], CancelledError), outcome
    blob = {path: n for path, n in proxy.bytes_sent.items() if "/blobs/" in path and n > 1000}
    assert blob and all(n < len(layer) for n in blob.values()), (blob, len(layer))
    assert not (root / "models" / storage_key(uri)).exists()
    assert not any(p.is_file() for p in staging.rglob("*") if "extract" in p.parts)


# ---- the backend contract (tests/contract.py; its resume after kill -9 replaced this module's) ----


class _RegistryTarget(ProxyTarget):
    """The registry behind a FaultProxy: one ORAS artifact per model (a file per blob). A new
    push of the tag is a new version (the pull is pinned to the digest it resolved)."""

    def __init__(self, registry: OCIRegistry, proxy: FaultProxy, tmp: Path) -> None:
        super().__init__(proxy)
        self.registry = registry
        self.tmp = tmp
        self.n = 0
        self.files: dict[str, dict[str, bytes]] = {}

    def _push(self, repo: str, files: dict[str, bytes]) -> None:
        self.n += 1
        push_artifact(self.registry, f"{self.registry.host}/{repo}:v1", self.tmp / f"push-{self.n}", files)

    def model(self, files: dict[str, bytes]) -> str:
        repo = f"contract/m{self.n + 1}"
        self._push(repo, files)
        uri = f"oci://127.0.0.1:{self.proxy.port}/{repo}:v1"
        self.files[uri] = dict(files)
        return uri

    def missing(self) -> str:
        return f"oci://127.0.0.1:{self.proxy.port}/contract/nothing:v1"

    def env(self) -> dict[str, str]:
        return {"KSERVE_OCI_INSECURE_REGISTRY": "true", "KSERVE_OCI_DOCKER_CONFIG": str(self.tmp / "none.json")}

    def replace(self, uri: str, path: str, data: bytes) -> None:
        self._push(uri.split("/", 3)[3].rsplit(":", 1)[0], {**self.files[uri], path: data})

    def data_path(self, uri: str, path: str) -> str:
        repo = uri.split("/", 3)[3].rsplit(":", 1)[0]
        return f"/v2/{repo}/blobs/sha256:{hashlib.sha256(self.files[uri][path]).hexdigest()}"


class TestRegistryContract(NetworkContract):
    @pytest.fixture
    def target(self, oci_registry: OCIRegistry, proxy: FaultProxy, tmp_path: Path) -> _RegistryTarget:
        return _RegistryTarget(oci_registry, proxy, tmp_path / "oci")
