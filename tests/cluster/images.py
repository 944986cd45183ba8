"""Images for the test nodes, made here (no registry can be reached) and loaded into their containerd.

- `static_image`: an OCI image archive of one static program of ours (tests/cluster/runtime/cmd):
  the pods' sandbox (`pause`) and the predictor pods' serving container (`serve`). One layer, the
  program alone; the tag is the program's digest, so a new build is a new reference and
  `imagePullPolicy: IfNotPresent` never asks a registry.
- `podman_archive`: an image of podman's storage (the project's, built by `make image`) as an OCI
  archive, written once per image ID.
- `ImageStore.load`: imports an archive into a node's containerd unless its record says the same
  image is there already (containerd's root is kept between runs: loading the project image
  costs ~10 s per node, skipping it nothing).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.build import NODE_IMAGES, REPO

ARCHIVES = REPO / ".work" / "cluster" / "image-archives"
#: Repository of our own node images (`localhost/...` is a registry host to containerd's parser).
PREFIX = "localhost/modelcache-test"


@dataclass(frozen=True)
class Archive:
    ref: str  # the image reference pods use
    path: Path  # an OCI image layout tar
    id: str  # what identifies the content (config digest or podman's image ID)


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def static_image(program: str, entrypoint: list[str] | None = None) -> Archive:
    """The one-layer image of ``program`` from NODE_IMAGES, as an OCI archive under ARCHIVES."""
    binary = NODE_IMAGES.bin_dir / program
    content = binary.read_bytes()
    tag = hashlib.sha256(content).hexdigest()[:16]
    ref = f"{PREFIX}/{program}:{tag}"
    path = ARCHIVES / f"{program}-{tag}.tar"
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
        info = tarfile.TarInfo(program)
        info.size, info.mode, info.mtime = len(content), 0o755, 0
        layer.addfile(info, io.BytesIO(content))
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode, tmp.mtime = tarfile.DIRTYPE, 0o1777, 0
        layer.addfile(tmp)
    layer_digest, layer_bytes = _blob(layer_buf.getvalue())
    config_digest, config_bytes = _blob(json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint or [f"/{program}"], "Env": ["PATH=/"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }, sort_keys=True).encode())
    if path.exists():
        return Archive(ref, path, config_digest)
    manifest_digest, manifest_bytes = _blob(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest,
                   "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest,
                    "size": len(layer_bytes)}],
    }, sort_keys=True).encode())
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
        "size": len(manifest_bytes),
        "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": tag}}]}).encode()
    ARCHIVES.mkdir(parents=True, exist_ok=True)
    for old in ARCHIVES.glob(f"{program}-*.tar"):
        old.unlink()
    partial = path.with_suffix(".partial")
    with tarfile.open(partial, "w") as tar:
        for name, data in [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index),
                           *((f"blobs/sha256/{d.split(':')[1]}", b) for d, b in (
                               (layer_digest, layer_bytes), (config_digest, config_bytes),
                               (manifest_digest, manifest_bytes)))]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    partial.rename(path)
    return Archive(ref, path, config_digest)


def podman_archive(ref: str, env: dict[str, str] | None = None) -> Archive:
    """podman's image ``ref`` as an OCI archive (written once per image ID; older ones removed)."""
    proc = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"podman has no image {ref} (`make image` builds it): {proc.stderr.strip()}")
    image_id = proc.stdout.strip()
    safe = ref.replace("/", "_").replace(":", "_")
    path = ARCHIVES / f"podman-{safe}-{image_id[:16]}.tar"
    if not path.exists():
        ARCHIVES.mkdir(parents=True, exist_ok=True)
        for old in ARCHIVES.glob(f"podman-{safe}-*.tar"):
            old.unlink()
        partial = path.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        save = subprocess.run(["podman", "save", "--format", "oci-archive", "-o", str(partial), ref],
                              capture_output=True, text=True, env=env)
        if save.returncode != 0:
            raise RuntimeError(f"podman save {ref} failed: {save.stderr.strip()}")
        partial.rename(path)
    return Archive(ref, path, image_id)


class ImageStore:
    """The images of one node's containerd (k8s.io namespace) and the record of what was loaded."""

    def __init__(self, ctr: list[str], record: Path) -> None:
        self.ctr = ctr
        self.record = record

    def _loaded(self) -> dict[str, str]:
        try:
            return dict(json.loads(self.record.read_text()))
        except (OSError, ValueError):
            return {}

    def present(self, ref: str) -> bool:
        out = subprocess.run([*self.ctr, "images", "ls", "-q", f"name=={ref}"], capture_output=True, text=True)
        return ref in out.stdout.split()

    def load(self, archive: Archive) -> bool:
        """Import ``archive`` unless the same image is there; True if it was imported."""
        loaded = self._loaded()
        if loaded.get(archive.ref) == archive.id and self.present(archive.ref):
            return False
        proc = subprocess.run([*self.ctr, "images", "import",
                               str(archive.path)], capture_output=True, text=True)
        if proc.returncode != 0 or not self.present(archive.ref):
            raise RuntimeError(f"importing {archive.ref} into containerd failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[-1500:]}")
        loaded[archive.ref] = archive.id
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(loaded, indent=1))
        os.replace(tmp, self.record)
        return True


def project_image() -> str:
    """The reference `make image` tags (IMAGE overrides deploy/kustomization.yaml's)."""
    proc = subprocess.run(["make", "-s", "print-image"], cwd=REPO, capture_output=True, text=True, check=True)
    return proc.stdout.strip()
