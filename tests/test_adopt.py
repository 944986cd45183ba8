"""Adoption: a model folder KServe's node agent filled (``models/<storageKey>/``, no manifest of ours)
is taken over in place: checked against the source's listing and checksums by hashing what is on
disk, only missing or different files fetched, the folder itself kept (pods mount it)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
from pathlib import Path

from modelcache.pull import pull
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.faultproxy import FaultProxy
from tests.fixtures.http import NginxServer

GIB = 1 << 30


def _sha256_of_zeros(size: int) -> str:
    h = hashlib.sha256()
    block = bytes(8 << 20)
    left = size
    while left:
        n = min(left, len(block))
        h.update(block[:n])
        left -= n
    return h.hexdigest()


def _repr_digest(hexdigest: str) -> dict[str, str]:
    return {"Repr-Digest": f"sha-256=:{base64.b64encode(bytes.fromhex(hexdigest)).decode()}:"}


def _model_bytes(nginx: NginxServer, rel: str) -> int:
    """Body bytes served for ``rel`` beyond the listing's probe (one ``Range: bytes=0-0`` GET that
    tells whether the server takes ranges): what a download would have read."""
    return sum(e.bytes_sent for e in nginx.requests_for(rel) if e.range != "bytes=0-0")


def _kserve_fill(root: Path, uri: str, files: dict[str, bytes | int]) -> Path:
    """What KServe's download Job leaves: the files under models/<storageKey>/, nothing else."""
    folder = root / "models" / storage_key(uri)
    for rel, data in files.items():
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, int):
            with open(p, "wb") as f:
                f.truncate(data)  # sparse zeros: a big file without the disk traffic
        else:
            p.write_bytes(data)
    return folder


def test_a_complete_multi_gib_folder_is_adopted_reading_zero_bytes_from_the_origin(nginx: NginxServer, tmp_path):
    size = 2 * GIB
    digest = _sha256_of_zeros(size)
    served = nginx.docroot / "big" / "model.safetensors"
    served.parent.mkdir(parents=True)
    with open(served, "wb") as f:
        f.truncate(size)
    os.chmod(served, 0o644)
    nginx.set_headers("big/model.safetensors", _repr_digest(digest))
    uri = nginx.url("big/model.safetensors")
    root = tmp_path / "root"
    folder = _kserve_fill(root, uri, {"model.safetensors": size})
    ino = folder.stat().st_ino
    nginx.clear_access_log()

    result = pull(uri, root=root)

    served_bytes = _model_bytes(nginx, "big/model.safetensors")
    print(f"adopted {size / GIB:.0f} GiB: {served_bytes} bytes of it read from the origin")
    assert served_bytes == 0
    assert [(e.method, e.range) for e in nginx.requests_for("big/model.safetensors", None)] == [
        ("HEAD", None), ("GET", "bytes=0-0")]  # the listing, nothing else
    assert result.adopted == 1 and result.adopted_bytes == size and not result.cached
    assert result.verified == ("sha256",)  # the bytes on disk were hashed against the source's digest
    store = NodeStore.at(root)
    assert store.is_present(storage_key(uri)) and folder.stat().st_ino == ino
    assert store.manifest(storage_key(uri)).files[0].checksums["sha256"] == digest
    # Present now: the next pull neither lists nor hashes.
    nginx.clear_access_log()
    assert pull(uri, root=root).cached and nginx.access_log() == []


def test_only_missing_or_different_files_are_fetched_into_the_same_folder(moto_s3, tmp_path):
    bucket = moto_s3.new_bucket()
    s3 = moto_s3.client()
    content = {"config.json": b'{"a": 1}', "w/a.bin": os.urandom(300_000), "w/b.bin": os.urandom(200_000),
               "w/c.bin": os.urandom(100_000)}
    for rel, data in content.items():
        s3.put_object(Bucket=bucket, Key=f"m/{rel}", Body=data)
    host, port = moto_s3.endpoint.removeprefix("http://").split(":")
    with FaultProxy((host, int(port))) as proxy:
        uri = f"s3://{bucket}/m"
        root = tmp_path / "root"
        wrong = bytearray(content["w/b.bin"])
        wrong[5000] ^= 0xFF  # same size, other bytes: only the source's MD5 tells
        folder = _kserve_fill(root, uri, {"config.json": content["config.json"], "w/a.bin": content["w/a.bin"],
                                          "w/b.bin": bytes(wrong), "extra/from-kserve.txt": b"kept"})
        inodes = {rel: (folder / rel).stat().st_ino for rel in ("config.json", "w/a.bin")}
        folder_ino = folder.stat().st_ino

        result = pull(uri, root=root, settings=_settings(moto_s3, proxy.base_url))

        fetched = {p.removeprefix(f"/{bucket}/m/"): n for p, n in proxy.bytes_sent.items()
                   if n and p.startswith(f"/{bucket}/m/")}  # object bodies (not the listing's XML)
        assert fetched == {"w/b.bin": 200_000, "w/c.bin": 100_000}
        assert result.adopted == 2 and result.files == 4
    for rel, data in content.items():
        assert (folder / rel).read_bytes() == data
    assert folder.stat().st_ino == folder_ino  # the folder a pod mounts stays
    assert {rel: (folder / rel).stat().st_ino for rel in inodes} == inodes  # kept files untouched
    # Not the model: moved out of the folder pods read (issue 33, F5), kept where the pull says.
    assert not (folder / "extra" / "from-kserve.txt").exists()
    assert result.set_aside == ("extra/from-kserve.txt",)
    assert [p.read_bytes() for p in Path(result.set_aside_to).rglob("from-kserve.txt")] == [b"kept"]
    store = NodeStore.at(root)
    assert store.verify(storage_key(uri)) == []
    assert {f.path for f in store.manifest(storage_key(uri)).files} == set(content)


def _settings(s3, endpoint: str):
    from modelcache.sources.credentials import Settings

    return Settings.from_env(s3.env(endpoint))


def test_without_source_checksums_a_file_is_kept_on_its_size_and_a_wrong_size_is_fetched(nginx, tmp_path):
    nginx.write("plain/model.bin", 1 << 20)
    uri = nginx.url("plain/model.bin")
    root = tmp_path / "root"
    data = (nginx.docroot / "plain" / "model.bin").read_bytes()
    folder = _kserve_fill(root, uri, {"model.bin": data})
    nginx.clear_access_log()
    result = pull(uri, root=root)
    assert result.adopted == 1 and _model_bytes(nginx, "plain/model.bin") == 0
    assert NodeStore.at(root).manifest(storage_key(uri)).files[0].checksums == {}  # size alone: recorded so

    uri2 = nginx.url("plain/model.bin?v=2")
    folder2 = _kserve_fill(root, uri2, {"model.bin": data[:1000]})
    nginx.clear_access_log()
    result2 = pull(uri2, root=root)
    assert result2.adopted == 0 and (folder2 / "model.bin").read_bytes() == data
    assert _model_bytes(nginx, "plain/model.bin") == len(data)
    assert folder.is_dir()


def _tar_gz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_node_store_keeps_an_archive_model_unpacked_as_kserve_does(nginx, tmp_path):
    """KServe's download Job runs the storage initializer, which unpacks a single archive: serving
    pods mount models/<storageKey>/ and expect the model's files there, not model.tar.gz."""
    files = {"config.json": b"{}", "weights/w.bin": os.urandom(50_000)}
    nginx.write("arch/model.tar.gz", _tar_gz(files))
    uri = nginx.url("arch/model.tar.gz")
    root = tmp_path / "root"
    result = pull(uri, root=root)
    folder = root / "models" / storage_key(uri)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == sorted(files)
    assert result.unpacked_from == "model.tar.gz" and result.files == 2
    store = NodeStore.at(root)
    assert {f.path for f in store.manifest(storage_key(uri)).files} == set(files)
    assert store.verify(storage_key(uri)) == [] and pull(uri, root=root).cached
    assert not (root / ".modelcache" / "staging" / storage_key(uri)).exists()


def test_an_archive_stored_whole_by_an_earlier_version_is_unpacked_without_a_download(nginx, tmp_path):
    files = {"config.json": b"{}", "w.bin": os.urandom(10_000)}
    nginx.write("old/model.tar.gz", _tar_gz(files))
    uri = nginx.url("old/model.tar.gz")
    root = tmp_path / "root"
    pull(uri, root=root, unpack=False)  # what the agent did before: the archive itself is the model
    folder = root / "models" / storage_key(uri)
    assert [p.name for p in folder.iterdir()] == ["model.tar.gz"]
    nginx.clear_access_log()
    result = pull(uri, root=root)
    assert _model_bytes(nginx, "old/model.tar.gz") == 0  # listed again, the archive's bytes kept
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "w.bin"]
    assert result.unpacked_from == "model.tar.gz" and NodeStore.at(root).verify(storage_key(uri)) == []


def test_a_folder_kserve_unpacked_from_an_archive_gets_the_archive_once_and_stays_in_place(nginx, tmp_path):
    """The archive's contents cannot be checked without the archive: it is fetched (once), unpacked
    beside the folder and its files renamed into it."""
    files = {"config.json": b"{}", "w.bin": os.urandom(10_000)}
    body = _tar_gz(files)
    nginx.write("k/model.tgz", body)
    uri = nginx.url("k/model.tgz")
    root = tmp_path / "root"
    folder = _kserve_fill(root, uri, files)
    ino = folder.stat().st_ino
    nginx.clear_access_log()
    pull(uri, root=root)
    assert _model_bytes(nginx, "k/model.tgz") == len(body)
    assert folder.stat().st_ino == ino and sorted(p.name for p in folder.iterdir()) == ["config.json", "w.bin"]
    assert NodeStore.at(root).is_present(storage_key(uri))


def test_a_folder_reported_complete_is_adopted_as_found_and_what_changed_is_drift_not_a_rewrite(moto_s3, tmp_path):
    """M3 of the v0.20 audit: KServe downloaded the model, then the objects were rewritten at the
    source. Adopted AS_FOUND (the folder was reported ModelDownloaded), nothing under the pods
    changes: the rewritten file is kept as KServe left it and reported changed, a file added at
    the source is reported added, an empty one is created (KServe skips empty objects); 0 bytes
    of the model are read from the origin."""
    from modelcache.adopt import AS_FOUND
    from modelcache.drift import CHANGED, KEPT_AS_FOUND
    from modelcache.pull import check_drift

    bucket = moto_s3.new_bucket()
    s3 = moto_s3.client()
    old = {"config.json": b'{"v": 1}', "w/a.bin": os.urandom(300_000), "w/b.bin": os.urandom(200_000)}
    new = {**old, "w/b.bin": os.urandom(200_000), "w/c.bin": os.urandom(50_000), "empty.txt": b""}
    for rel, data in new.items():
        s3.put_object(Bucket=bucket, Key=f"m/{rel}", Body=data)  # the source today
    host, port = moto_s3.endpoint.removeprefix("http://").split(":")
    with FaultProxy((host, int(port))) as proxy:
        uri = f"s3://{bucket}/m"
        root = tmp_path / "root"
        folder = _kserve_fill(root, uri, old)  # what KServe downloaded before the rewrite
        inodes = {rel: (folder / rel).stat().st_ino for rel in old}

        result = pull(uri, root=root, settings=_settings(moto_s3, proxy.base_url), adoption=AS_FOUND)

        fetched = {p.removeprefix(f"/{bucket}/m/"): n for p, n in proxy.bytes_sent.items()
                   if n and p.startswith(f"/{bucket}/m/")}
    assert fetched == {}
    assert {rel: (folder / rel).read_bytes() for rel in old} == old  # nothing rewritten under the pods
    assert {rel: (folder / rel).stat().st_ino for rel in old} == inodes
    assert (folder / "empty.txt").read_bytes() == b"" and not (folder / "w" / "c.bin").exists()
    assert result.kept_as_found == ("w/b.bin",) and result.absent == ("w/c.bin",)
    assert result.drift is not None and result.drift.state == CHANGED
    assert result.drift.changed == ("w/b.bin",) and result.drift.added == ("w/c.bin",)
    store = NodeStore.at(root)
    key = storage_key(uri)
    assert store.is_present(key) and store.verify(key) == []
    files = {f.path: f for f in store.manifest(key).files}
    assert set(files) == {"config.json", "w/a.bin", "w/b.bin", "empty.txt"}
    assert files["w/b.bin"].version == KEPT_AS_FOUND and files["w/b.bin"].checksums == {}
    assert files["w/a.bin"].checksums  # verified by the source's MD5
    # The drift check (`pull --check`, the agent's periodic one) keeps saying so until a refresh.
    later = check_drift(uri, store.manifest(key), _settings(moto_s3, moto_s3.endpoint))
    assert later.state == CHANGED and set(later.changed) == {"w/b.bin"} and set(later.added) == {"w/c.bin"}
    refreshed = pull(uri, root=root, settings=_settings(moto_s3, moto_s3.endpoint), refresh=True)
    assert set(refreshed.refreshed) == {"w/b.bin", "w/c.bin"}
    assert {rel: (store.layout.model_dir(key) / rel).read_bytes() for rel in new} == new


def test_a_folder_reported_complete_that_holds_none_of_the_listed_files_is_not_adopted(moto_s3, tmp_path):
    from modelcache.adopt import AS_FOUND
    from modelcache.errors import ModelcacheError

    bucket = moto_s3.new_bucket()
    moto_s3.client().put_object(Bucket=bucket, Key="m/model.bin", Body=b"x" * 100)
    uri = f"s3://{bucket}/m"
    root = tmp_path / "root"
    _kserve_fill(root, uri, {"other.bin": b"y" * 10})
    try:
        pull(uri, root=root, settings=_settings(moto_s3, moto_s3.endpoint), adoption=AS_FOUND)
    except ModelcacheError as exc:
        assert "holds none of the 1 files the source lists" in str(exc)
    else:
        raise AssertionError("adopted a folder that holds none of the model's files")
    assert not NodeStore.at(root).is_present(storage_key(uri))


def test_an_archive_model_reported_complete_is_compared_with_the_archive_not_merged(nginx, tmp_path):
    """L1 and M3 of the v0.20 audit: KServe unpacked the archive and deleted it; the archive was
    replaced at the source since. Only the archive can verify the folder, so it is fetched once
    (its bytes, no more: the unpacked copy is staged beside the folder, then dropped), and each
    file is compared: the same bytes kept as verified, the others kept as found and reported,
    nothing renamed into the folder pods read."""
    from modelcache.adopt import AS_FOUND
    from modelcache.drift import KEPT_AS_FOUND

    old = {"config.json": b"{}", "w.bin": os.urandom(10_000)}
    new = {**old, "w.bin": os.urandom(10_000), "extra.txt": b"new"}
    body = _tar_gz(new)
    nginx.write("ka/model.tgz", body)
    uri = nginx.url("ka/model.tgz")
    root = tmp_path / "root"
    folder = _kserve_fill(root, uri, old)
    inodes = {p.name: p.stat().st_ino for p in folder.iterdir()}
    nginx.clear_access_log()
    result = pull(uri, root=root, adoption=AS_FOUND)
    assert _model_bytes(nginx, "ka/model.tgz") == len(body)
    assert {p.name: p.stat().st_ino for p in folder.iterdir()} == inodes  # nothing renamed or added
    assert (folder / "w.bin").read_bytes() == old["w.bin"]
    assert result.kept_as_found == ("w.bin",) and result.absent == ("extra.txt",)
    assert result.drift is not None and "differ from model.tgz" in result.drift.message
    store = NodeStore.at(root)
    files = {f.path: f for f in store.manifest(storage_key(uri)).files}
    assert set(files) == {"config.json", "w.bin"} and files["w.bin"].version == KEPT_AS_FOUND
    assert store.verify(storage_key(uri)) == [] and not list((root / ".modelcache" / "staging").glob("*/data/*"))


# ---- what an adopted folder holds beyond the model, and links out of it (issue 33, F5) -----------


def _cli_json(*args: str) -> list[dict[str, object]]:
    from tests.pull_helpers import run_cli

    out = run_cli(*args, "--json")
    assert out.returncode == 0, out.stderr
    import json

    return json.loads(out.stdout)


def test_f5_unlisted_files_leave_the_folder_and_a_linked_sub_folder_is_never_followed(tmp_path: Path) -> None:
    """F5: a ``file://`` origin (model.safetensors, sub/tok.json) and a pre-filled folder with the
    right model.safetensors, an extra pytorch_model.bin, and ``sub`` a link to a folder outside the
    store holding a same-size wrong tok.json: the pull kept the extra file where pods see it and
    adopted the wrong tok.json through the link (size alone); ``verify`` said ok."""
    from tests.pull_helpers import run_cli

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    weights = os.urandom(200_000)
    (src / "model.safetensors").write_bytes(weights)
    (src / "sub" / "tok.json").write_bytes(b'{"tok": "right"}')
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tok.json").write_bytes(b'{"tok": "wrong"}')  # same size
    uri = f"file://{src}"
    root = tmp_path / "root"
    folder = _kserve_fill(root, uri, {"model.safetensors": weights, "pytorch_model.bin": b"stale weights",
                                      ".cache/huggingface/download/model.safetensors.metadata": b"meta"})
    os.symlink(outside, folder / "sub")
    inode = (folder / "model.safetensors").stat().st_ino

    (res,) = _cli_json("pull", uri, "--root", str(root), "--progress", "none")
    assert res["adopted"] == 1 and res["set_aside"] == [
        ".cache/huggingface/download/model.safetensors.metadata", "pytorch_model.bin", "sub"]
    assert (folder / "model.safetensors").stat().st_ino == inode  # adopted in place
    assert not (folder / "sub").is_symlink() and (folder / "sub" / "tok.json").read_bytes() == b'{"tok": "right"}'
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "sub"]
    assert (outside / "tok.json").read_bytes() == b'{"tok": "wrong"}'  # nothing written through the link
    aside = Path(str(res["set_aside_to"]))
    assert [p.read_bytes() for p in aside.rglob("pytorch_model.bin")] == [b"stale weights"]
    assert [p for p in aside.rglob("sub") if p.is_symlink()], "the link itself is kept, not what it names"
    assert run_cli("verify", "--root", str(root)).returncode == 0
    # Kept on its size alone (file:// gives no checksum): said so, and a refresh fetches it again.
    listing = run_cli("ls", "--root", str(root))
    assert f"{storage_key(uri)}  unverified" in listing.stdout, listing.stdout
    check = run_cli("pull", "--check", uri, "--root", str(root))
    assert "unknown" in check.stdout and "model.safetensors: adopted on their size alone" in check.stdout
    (again,) = _cli_json("pull", "--refresh", uri, "--root", str(root), "--progress", "none")
    assert again["refreshed"] == ["model.safetensors"] and again["unverified"] == []
    assert f"{storage_key(uri)}  present" in run_cli("ls", "--root", str(root)).stdout
    # rm by name takes what was set aside with the model.
    assert run_cli("rm", storage_key(uri), "--root", str(root)).returncode == 0
    assert not aside.exists()


def test_f5_a_model_folder_that_is_a_link_out_of_the_store_is_replaced_not_merged_into(tmp_path: Path) -> None:
    from tests.pull_helpers import run_cli

    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(100_000))
    uri = f"file://{src}"
    root = tmp_path / "root"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "w.bin").write_bytes(os.urandom(100_000))  # same size, other bytes
    before = (elsewhere / "w.bin").read_bytes()
    (root / "models").mkdir(parents=True)
    os.symlink(elsewhere, root / "models" / storage_key(uri))
    (res,) = _cli_json("pull", uri, "--root", str(root), "--progress", "none")
    folder = root / "models" / storage_key(uri)
    assert res["adopted"] == 0 and not folder.is_symlink()
    assert (folder / "w.bin").read_bytes() == (src / "w.bin").read_bytes()
    assert (elsewhere / "w.bin").read_bytes() == before  # what the link named is untouched
    assert run_cli("verify", "--root", str(root)).returncode == 0


def test_a_file_with_holes_is_not_adopted_on_its_size(tmp_path: Path) -> None:
    """A right-sized file that was never written whole (``truncate -s``, a preallocated or cut copy)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(300_000))
    uri = f"file://{src}"
    root = tmp_path / "root"
    _kserve_fill(root, uri, {"w.bin": 300_000})
    (res,) = _cli_json("pull", uri, "--root", str(root), "--progress", "none")
    assert res["adopted"] == 0
    assert (root / "models" / storage_key(uri) / "w.bin").read_bytes() == (src / "w.bin").read_bytes()


def test_an_agent_that_adopts_files_on_their_size_says_so_in_its_status(tmp_path: Path) -> None:
    """Issue 33, point 1: sizes alone only where nothing else exists, and then said in status."""
    from tests.agent_util import run_agent, status_of, write_node

    src = tmp_path / "src"
    src.mkdir()
    weights = os.urandom(100_000)
    (src / "w.bin").write_bytes(weights)
    uri = f"file://{src}"
    root = tmp_path / "root"
    _kserve_fill(root, uri, {"w.bin": weights})
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": uri}])
    proc = run_agent(spec, root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    detail = status_of(spec)["modelDetails"]["m"]
    assert detail["state"] == "ModelDownloaded"
    assert detail["message"].startswith("unverified: 1 file(s) adopted on their size alone"), detail
