"""The OCI source against a real distribution v2 registry: listing, ranged reads, modelcar
extraction, pinning, and each error case's message."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import oras.client
import pytest
import zstandard

from modelcache.errors import AuthError, IntegrityError, NotFoundError, SourceError, UnsupportedError
from modelcache.sources.base import RemoteFile, open_source
from modelcache.sources.credentials import Settings
from modelcache.sources.oci import node_arch
from modelcache.sources.oci_layers import UnsafeArchiveError
from modelcache.sources.oci_registry import OCI_INDEX, api_endpoint, docker_config_credentials
from tests.fixtures.oci import LAYER_TAR, LAYER_TGZ, LAYER_TZST, OCIRegistry, docker_config, make_tar


def settings(tmp_path: Path, insecure: bool = True, config: Path | None = None) -> Settings:
    return Settings.from_env(
        {
            "KSERVE_OCI_INSECURE_REGISTRY": "true" if insecure else "false",
            "KSERVE_OCI_DOCKER_CONFIG": str(config or tmp_path / "no-docker-config.json"),
        }
    )


def read_all(src, f: RemoteFile, chunk: int) -> bytes:
    out = bytearray()
    assert f.size is not None
    for start in range(0, f.size, chunk):
        stream = src.open_range(f, start, min(start + chunk, f.size))
        buf = memoryview(bytearray(64 << 10))
        while n := stream.readinto(buf):
            out += buf[:n]
        stream.close()
    return bytes(out)


def push_artifact(reg: OCIRegistry, target: str, tmp: Path, files: dict[str, bytes]) -> None:
    """oras push with nested titles (oras-py titles by basename; the annotation file sets the path)."""
    src = tmp / "artifact"
    paths, annotations = [], {}
    for rel, data in files.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        paths.append(str(p))
        annotations[str(p)] = {"org.opencontainers.image.title": rel}
    ann = tmp / "annotations.json"
    ann.write_text(json.dumps(annotations))
    client = oras.client.OrasClient(hostname=reg.host, insecure=True)
    client.push(target=target, files=paths, annotation_file=str(ann), disable_path_validation=True)


def test_artifact_nested_listing_and_ranged_reads(oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    big = os.urandom(3 * 1024 * 1024 + 123)
    files = {"config.json": b'{"a": 1}', "weights/part-1/model.safetensors": big, "tok/vocab.txt": b"x" * 1000}
    push_artifact(oci_registry, f"{oci_registry.host}/{oci_repo}:v1", tmp_path, files)
    with open_source(f"oci://{oci_registry.host}/{oci_repo}:v1", settings(tmp_path)) as src:
        listed = {f.path: f for f in src.list_files()}
        assert sorted(listed) == sorted(files)
        for rel, data in files.items():
            f = listed[rel]
            assert f.size == len(data)
            assert f.checksums[0].algo == "sha256"
            assert f.checksums[0].value == hashlib.sha256(data).hexdigest()
        assert read_all(src, listed["weights/part-1/model.safetensors"], 1 << 20) == big
        assert src.extract_into(str(tmp_path / "unused"), lambda n: None) is None
        assert src.resolved_uri.startswith(f"oci://{oci_registry.host}/{oci_repo}@sha256:")


def test_tag_moved_after_resolution_still_reads_the_pinned_digest(
    oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path
) -> None:
    v1, v2 = os.urandom(200_000), os.urandom(200_000)
    ref = f"{oci_registry.host}/{oci_repo}:latest"
    push_artifact(oci_registry, ref, tmp_path / "a", {"model.bin": v1})
    with open_source(f"oci://{ref}", settings(tmp_path)) as src:
        (f,) = src.list_files()
        pinned = src.resolved_uri
        push_artifact(oci_registry, ref, tmp_path / "b", {"model.bin": v2})  # the tag moves mid-pull
        assert read_all(src, f, 64 << 10) == v1
        assert src.resolved_uri == pinned
    with open_source(pinned, settings(tmp_path)) as again:
        (f2,) = again.list_files()
        assert f2.checksums == f.checksums
    with open_source(f"oci://{ref}", settings(tmp_path)) as moved:
        assert moved.list_files()[0].checksums[0].value == hashlib.sha256(v2).hexdigest()
        assert moved.resolved_uri != pinned


def test_modelcar_layers_whiteouts_and_links(oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    weights = os.urandom(500_000)
    base = make_tar(
        [
            ("bin", None),
            ("bin/sh", b"not a model"),
            ("models", None),
            ("models/old.bin", b"old"),
            ("models/stale", None),
            ("models/stale/x", b"x"),
            ("models/sub/dir/w.bin", weights),
        ]
    )
    top = make_tar(
        [
            ("./models/.wh.old.bin", b""),
            ("models/stale/.wh..wh..opq", b""),
            ("models/stale/new", b"new"),
            ("models/config.json", b"{}"),
            ("models/link.bin", "->", "sub/dir/w.bin"),
            ("models/linkdir", "->", "sub"),
            ("models/dangling", "->", "nowhere"),
            ("models/hard.bin", "=>", "models/config.json"),
        ],
        gzip_it=True,
    )
    zst = zstandard.ZstdCompressor().compress(make_tar([("models/zz/z.txt", b"zstd layer")]))
    oci_registry.push_image(oci_repo, "v1", [(base, LAYER_TAR), (top, LAYER_TGZ), (zst, LAYER_TZST)])
    staging = tmp_path / "staging"
    seen: list[int] = []
    with open_source(f"oci://{oci_registry.host}/{oci_repo}:v1", settings(tmp_path)) as src:
        layers = src.list_files()
        assert [f.size for f in layers] == [len(base), len(top), len(zst)]
        files = src.extract_into(str(staging), seen.append)
    assert files == ["config.json", "hard.bin", "link.bin", "stale/new", "sub/dir/w.bin", "zz/z.txt"]
    assert sum(seen) == len(base) + len(top) + len(zst)
    assert (staging / "zz/z.txt").read_bytes() == b"zstd layer"
    assert (staging / "sub/dir/w.bin").read_bytes() == weights
    assert os.readlink(staging / "link.bin") == "sub/dir/w.bin"
    assert os.readlink(staging / "linkdir") == "sub"  # kept, but not listed as a file
    assert (staging / "hard.bin").read_bytes() == b"{}"
    assert not (staging / "old.bin").exists() and not (staging / "bin").exists()


def test_index_resolves_to_node_platform(oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    mine = oci_registry.push_image(oci_repo, "mine", [(make_tar([("models/m.txt", b"mine")]), LAYER_TAR)])
    other = oci_registry.push_image(oci_repo, "other", [(make_tar([("models/m.txt", b"other")]), LAYER_TAR)])
    other_arch = "s390x" if node_arch() != "s390x" else "amd64"
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": d,
                "size": 1,
                "platform": {"os": "linux", "architecture": arch},
            }
            for d, arch in ((other, other_arch), (mine, node_arch()))
        ],
    }
    # sizes are informative only for this test; distribution checks referenced manifests exist
    for m in index["manifests"]:
        m["size"] = 100
    digest = oci_registry.push_manifest(oci_repo, "multi", index, OCI_INDEX)
    with open_source(f"oci://{oci_registry.host}/{oci_repo}:multi", settings(tmp_path)) as src:
        files = src.extract_into(str(tmp_path / "s"), lambda n: None)
        assert src.resolved_uri.endswith("@" + digest)
    assert files == ["m.txt"]
    assert (tmp_path / "s/m.txt").read_bytes() == b"mine"
    # An index without this node's platform: one line naming the URI, the platform and what it has.
    index["manifests"] = index["manifests"][:1]
    oci_registry.push_manifest(oci_repo, "foreign", index, OCI_INDEX)
    uri = f"oci://{oci_registry.host}/{oci_repo}:foreign"
    with open_source(uri, settings(tmp_path)) as src, pytest.raises(NotFoundError) as err:
        src.list_files()
    msg = str(err.value)
    assert uri in msg and f"no linux/{node_arch()} image" in msg and f"linux/{other_arch}" in msg, msg


@pytest.mark.parametrize(
    "entries, needle",
    [
        ([("models/../../escape.txt", b"x")], "escapes the model folder"),
        ([("../models/x", b"x")], "escapes the model folder"),
        ([("models/evil", "->", "/etc/passwd")], "points outside"),
        ([("models/evil", "->", "../../etc")], "points outside"),
        ([("models/sub/d", "->", ".."), ("models/e", "->", "sub/d/..")], "resolves outside"),
        ([("models/d", "->", "."), ("models/d/x", b"x")], "through a symlink"),
        ([("models/h", "=>", "etc/passwd")], "points outside"),
        ([("models/p", "fifo")], "FIFO"),
    ],
)
def test_modelcar_escape_entries_are_refused(
    oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path, entries: list, needle: str
) -> None:
    oci_registry.push_image(oci_repo, "evil", [(make_tar([("models/ok.txt", b"ok"), *entries]), LAYER_TAR)])
    staging = tmp_path / "deep/staging"
    uri = f"oci://{oci_registry.host}/{oci_repo}:evil"
    with open_source(uri, settings(tmp_path)) as src, pytest.raises(UnsafeArchiveError) as err:
        src.extract_into(str(staging), lambda n: None)
    msg = str(err.value)
    assert needle in msg and uri in msg and "\n" not in msg
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "deep/escape.txt").exists()


def test_corrupted_layer_fails_verification(oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    layer = make_tar([("models/w.bin", os.urandom(100_000))])
    oci_registry.push_image(oci_repo, "v1", [(layer, LAYER_TAR)])
    digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    blob = oci_registry.blob_path(digest)
    data = bytearray(blob.read_bytes())
    data[5000] ^= 0xFF  # inside the file body: the tar still parses
    blob.write_bytes(bytes(data))
    with (
        open_source(f"oci://{oci_registry.host}/{oci_repo}:v1", settings(tmp_path)) as src,
        pytest.raises(IntegrityError, match="failed verification"),
    ):
        src.extract_into(str(tmp_path / "s"), lambda n: None)


def test_error_messages(oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    host = oci_registry.host
    oci_registry.push_image(oci_repo, "v1", [(make_tar([("etc/hosts", b"h")]), LAYER_TAR)])
    oci_registry.push_image(oci_repo, "weird", [(b"\x00" * 10, "application/vnd.example.blob")])
    oci_registry.push_image(oci_repo, "zstd", [(b"(\xb5/\xfd", "application/vnd.oci.image.layer.v1.tar+zstd")])

    def fail(uri: str, exc: type[Exception], needle: str, **kw: object) -> None:
        with open_source(uri, settings(tmp_path, **kw)) as src, pytest.raises(exc) as err:  # type: ignore[arg-type]
            src.extract_into(str(tmp_path / "s"), lambda n: None)
        msg = str(err.value)
        assert needle in msg and "\n" not in msg, msg
        assert uri in msg, msg  # the whole URI, not just the host

    fail(f"oci://{host}/{oci_repo}:nope", NotFoundError, "tag 'nope' not found")
    # distribution answers MANIFEST_UNKNOWN (not NAME_UNKNOWN) for a repository never pushed
    fail(f"oci://{host}/models/never-pushed:v1", NotFoundError, "not found in")
    fail(f"oci://{host}/{oci_repo}:v1", NotFoundError, "has no /models/ directory")
    fail(f"oci://{host}/{oci_repo}:weird", UnsupportedError, "layer media type 'application/vnd.example.blob'")
    fail(f"oci://{host}/{oci_repo}:zstd", IntegrityError, "is not a valid tar stream")
    fail(f"oci://{host}/{oci_repo}:v1", SourceError, "KSERVE_OCI_INSECURE_REGISTRY", insecure=False)


def test_auth_from_docker_config(oci_auth_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    reg = oci_auth_registry
    reg.push_image(oci_repo, "v1", [(make_tar([("models/a.txt", b"secret model")]), LAYER_TAR)])
    uri = f"oci://{reg.host}/{oci_repo}:v1"
    with open_source(uri, settings(tmp_path)) as src, pytest.raises(AuthError) as err:
        src.list_files()
    assert "unauthorized" in str(err.value) and "KSERVE_OCI_DOCKER_CONFIG" in str(err.value)
    assert reg.auth is not None and reg.auth[1] not in str(err.value)
    cfg = docker_config(tmp_path / "config.json", reg.host, *reg.auth)
    with open_source(uri, settings(tmp_path, config=cfg)) as src:
        assert src.extract_into(str(tmp_path / "s"), lambda n: None) == ["a.txt"]
    # keys written as URLs, and username/password fields, as other tools write them
    url_key = tmp_path / "url-key.json"
    url_key.write_text(
        json.dumps({"auths": {f"http://{reg.host}/v2/": {"username": reg.auth[0], "password": reg.auth[1]}}})
    )
    with open_source(uri, settings(tmp_path, config=url_key)) as src:
        assert src.list_files()[0].size
    wrong = docker_config(tmp_path / "wrong.json", reg.host, reg.auth[0], "not-the-password")
    with open_source(uri, settings(tmp_path, config=wrong)) as src, pytest.raises(AuthError):
        src.list_files()


def test_oras_directory_layer_is_unpacked(oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    """`oras push ref ./dir` makes one tar+gzip layer marked for unpacking, titled by the folder."""
    folder = tmp_path / "ocimodel"
    (folder / "nested").mkdir(parents=True)
    (folder / "nested/w.bin").write_bytes(b"w" * 70_000)
    (folder / "config.json").write_bytes(b"{}")
    ref = f"{oci_registry.host}/{oci_repo}:dir"
    oras.client.OrasClient(hostname=oci_registry.host, insecure=True).push(
        target=ref, files=[str(folder)], disable_path_validation=True
    )
    with open_source(f"oci://{ref}", settings(tmp_path)) as src:
        files = src.extract_into(str(tmp_path / "s"), lambda n: None)
    assert files == ["ocimodel/config.json", "ocimodel/nested/w.bin"]
    assert (tmp_path / "s/ocimodel/nested/w.bin").read_bytes() == b"w" * 70_000


def test_bearer_token_auth(oci_token_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    """The Bearer flow of Docker Hub, GHCR, Harbor...: 401 challenge -> token server (oras) -> retry."""
    reg = oci_token_registry
    assert reg.auth is not None
    big = os.urandom(300_000)
    reg.push_image(oci_repo, "v1", [(make_tar([("models/w.bin", big)]), LAYER_TAR)])
    uri = f"oci://{reg.host}/{oci_repo}:v1"
    with open_source(uri, settings(tmp_path)) as src, pytest.raises(AuthError, match="unauthorized"):
        src.list_files()
    cfg = docker_config(tmp_path / "config.json", reg.host, *reg.auth)
    with open_source(uri, settings(tmp_path, config=cfg)) as src:
        (layer,) = src.list_files()
        assert src.extract_into(str(tmp_path / "s"), lambda n: None) == ["w.bin"]
        first = read_all(src, layer, 100_000)  # ranged blob reads reuse the token
        assert hashlib.sha256(first).hexdigest() == layer.checksums[0].value
    assert (tmp_path / "s/w.bin").read_bytes() == big


def test_docker_hub_names(tmp_path: Path) -> None:
    assert api_endpoint("docker.io", "kserve-model") == ("registry-1.docker.io", "library/kserve-model")
    assert api_endpoint("index.docker.io", "org/model") == ("registry-1.docker.io", "org/model")
    assert api_endpoint("ghcr.io", "org/model") == ("ghcr.io", "org/model")
    cfg = docker_config(tmp_path / "c.json", "https://index.docker.io/v1/", "hubuser", "hubpass")
    assert docker_config_credentials(str(cfg), "docker.io") == ("hubuser", "hubpass")
    assert docker_config_credentials(str(cfg), "ghcr.io") is None


def test_oci_settings_as_kserve_reads_them() -> None:
    """KServe's defaults and spellings: the docker config at /mnt/oci-fetch-auth/config.json,
    KSERVE_OCI_INSECURE_REGISTRY true for 1/true/yes only."""
    default = Settings.from_env({})
    assert default.oci.docker_config == "/mnt/oci-fetch-auth/config.json" and default.oci.insecure is False
    assert Settings.from_env({"KSERVE_OCI_DOCKER_CONFIG": "/x/c.json"}).oci.docker_config == "/x/c.json"
    for value, want in (("1", True), ("true", True), ("YES", True), ("false", False), ("0", False), ("", False)):
        assert Settings.from_env({"KSERVE_OCI_INSECURE_REGISTRY": value}).oci.insecure is want, value
