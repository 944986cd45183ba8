"""OCI registries: ``oci://registry/repository[:tag|@sha256:digest]`` (also ``oci+fetch://`` etc.).

The reference is resolved to a manifest digest once; every later read is by digest, so a tag
moved during a pull cannot mix two versions. Two layouts are understood:

* an ORAS artifact: one blob per file, named by the ``org.opencontainers.image.title``
  annotation. ``list_files`` gives one RemoteFile per blob (sha256 checksum) and the transfer
  engine reads them by ranged blob GETs, in parallel chunks.
* a KServe "modelcar" image: tar layers holding ``/models/...``. ``extract_into`` streams the
  layers, verifies each digest and unpacks only ``models/`` (see ``oci_layers``). ORAS
  directory layers (``io.deis.oras.content.unpack``) take the same path.

The registry protocol and auth (through oras) live in ``oci_registry``.
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, cast

import requests
import urllib3

from modelcache.errors import IntegrityError, NotFoundError, TransientError, UnsupportedError
from modelcache.sources.base import Checksum, RangeStream, RemoteFile, Source, safe_relpath
from modelcache.sources.httpread import make_pool
from modelcache.sources.oci_layers import DigestReader, LayerExtractor, corrupt_stream_errors, open_layer_tar
from modelcache.sources.oci_registry import INDEX_TYPES, MANIFEST_TYPES, RegistryClient
from modelcache.sources.ratelimit import wait_out
from modelcache.sources.uri import OCILocation

if TYPE_CHECKING:
    from modelcache.sources.credentials import Settings

TITLE = "org.opencontainers.image.title"
ORAS_UNPACK = "io.deis.oras.content.unpack"
ORAS_DIR_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
_READ_CHUNK = 1 << 20

# platform.machine() -> GOARCH, as image indexes name architectures.
_GOARCH = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "armv7l": "arm",
    "riscv64": "riscv64",
}


def node_arch() -> str:
    machine = platform.machine().lower()
    return _GOARCH.get(machine, machine)


@dataclass(frozen=True)
class Layer:
    digest: str
    size: int | None
    media_type: str
    title: str | None = None
    unpack: bool = False


@dataclass
class Plan:
    """What one resolved manifest means for the download."""

    digest: str  # of the reference the user gave (an index stays the index)
    layout: str  # "artifact" (ranged blobs) or "layers" (streamed, unpacked)
    files: list[RemoteFile] = field(default_factory=list)
    layers: list[Layer] = field(default_factory=list)


class OCISource(Source):
    max_streams = 8
    applies_patterns = False  # an image is pulled whole, as KServe does

    def __init__(self, location: OCILocation, settings: Settings) -> None:
        super().__init__(location, settings)
        self.loc = location
        self.where = location.display
        self.client = RegistryClient(location.registry, location.repository, settings, self.where)
        http = settings.http
        self.pool = make_pool(http.ca_bundle or True, self.max_streams, http.connect_timeout, http.read_timeout)
        self._plan: Plan | None = None

    # -- resolution -------------------------------------------------------------------------

    def plan(self) -> Plan:
        if self._plan is None:
            # The listing is not retried by the engine: a 429 on the manifests waits Retry-After here.
            self._plan = wait_out(self._resolve, self.where)
            self._resolved = f"oci://{self.loc.registry}/{self.loc.repository}@{self._plan.digest}"
        return self._plan

    def _resolve(self) -> Plan:
        ref = self.loc.reference
        what = f"digest {ref}" if self.loc.digest else f"tag '{ref}'"
        doc, digest, media_type = self.client.manifest(ref, what)
        if media_type in INDEX_TYPES or ("manifests" in doc and "layers" not in doc):
            child = self._pick_platform(doc)
            doc, _, media_type = self.client.manifest(child, f"manifest {child}")
        if media_type not in MANIFEST_TYPES and "layers" not in doc:
            raise UnsupportedError(f"{self.where}: unsupported manifest media type '{media_type}'")
        layers = [
            Layer(
                digest=str(d["digest"]),
                size=int(d["size"]) if d.get("size") is not None else None,
                media_type=str(d.get("mediaType", "")),
                title=(d.get("annotations") or {}).get(TITLE),
                # oras marks a pushed folder with the unpack annotation (Go CLI) or only by its
                # tar+gzip media type (oras-py); both unpack it on pull, so do we.
                unpack=str((d.get("annotations") or {}).get(ORAS_UNPACK, "")).lower() == "true"
                or d.get("mediaType") == ORAS_DIR_MEDIA_TYPE,
            )
            for d in doc.get("layers") or []
        ]
        if not layers:
            raise NotFoundError(f"{self.where}: the image has no layers, so no /models/ directory")
        titled = [la for la in layers if la.title]
        if titled and not any(la.unpack for la in titled):
            return Plan(digest=digest, layout="artifact", files=[self._blob_file(la) for la in titled])
        if titled:
            return Plan(digest=digest, layout="layers", layers=titled)
        return Plan(digest=digest, layout="layers", layers=layers)

    def _pick_platform(self, index: dict[str, Any]) -> str:
        arch = node_arch()
        entries = index.get("manifests") or []
        for entry in entries:
            plat = entry.get("platform") or {}
            if plat.get("os") == "linux" and plat.get("architecture") == arch:
                return str(entry["digest"])
        if len(entries) == 1 and not entries[0].get("platform"):
            return str(entries[0]["digest"])
        found = sorted(
            f"{(e.get('platform') or {}).get('os')}/{(e.get('platform') or {}).get('architecture')}" for e in entries
        )
        raise NotFoundError(f"{self.where}: the image index has no linux/{arch} image (has: {', '.join(found)})")

    def _blob_file(self, layer: Layer) -> RemoteFile:
        algo, _, value = layer.digest.partition(":")
        return RemoteFile(
            path=safe_relpath(layer.title or "", self.where),
            size=layer.size,
            version=layer.digest,
            checksums=(Checksum(algo, value),),
            ranged=True,
            meta=(("oci.digest", layer.digest), ("oci.mediaType", layer.media_type)),
        )

    # -- Source API -------------------------------------------------------------------------

    def list_files(self) -> list[RemoteFile]:
        """ORAS artifact: its files. Layer image: its layers (for sizing; ``extract_into`` fetches)."""
        plan = self.plan()
        if plan.layout == "artifact":
            return list(plan.files)
        return [
            RemoteFile(
                path=la.digest.replace(":", "-") + ".layer",
                size=la.size,
                version=la.digest,
                checksums=(Checksum(la.digest.partition(":")[0], la.digest.partition(":")[2]),),
                ranged=False,
                meta=(("oci.digest", la.digest), ("oci.mediaType", la.media_type), ("oci.layer", "true")),
            )
            for la in plan.layers
        ]

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        digest = file.meta_get("oci.digest") or file.version or ""
        return self.client.open_blob(self.pool, file, digest, start, end, f"{self.where}: {file.path}")

    def extract_into(self, staging_dir: str, on_bytes: Callable[[int], None]) -> list[str] | None:
        plan = self.plan()
        if plan.layout == "artifact":
            return None
        try:
            return self._extract(plan, staging_dir, on_bytes)
        except BaseException:
            # Unpacked layers cannot be resumed (the next pull streams them again), so a failed
            # extraction leaves nothing behind: its partial tree would only hold disk space.
            shutil.rmtree(staging_dir, ignore_errors=True)
            raise

    def _extract(self, plan: Plan, staging_dir: str, on_bytes: Callable[[int], None]) -> list[str]:
        os.makedirs(staging_dir, exist_ok=True)
        modelcar = LayerExtractor(staging_dir, self.where, prefix="models")
        for layer in plan.layers:
            if layer.title and not layer.unpack:
                self._write_blob(layer, staging_dir, on_bytes)
                continue
            extractor = LayerExtractor(staging_dir, self.where, prefix=None) if layer.title else modelcar
            self._apply_layer(layer, extractor, on_bytes)
        if not plan.layers[0].title and not modelcar.seen:
            raise NotFoundError(
                f"OCI image at {self.where} has no /models/ directory; a modelcar image keeps the model in /models"
            )
        files = modelcar.files()
        if not files:
            raise NotFoundError(f"OCI image at {self.where} has an empty /models/ directory")
        return files

    def _apply_layer(self, layer: Layer, extractor: LayerExtractor, on_bytes: Callable[[int], None]) -> None:
        resp = self.client.blob(layer.digest)
        try:
            reader = DigestReader(resp.raw, on_bytes)
            with open_layer_tar(cast(IO[bytes], reader), layer.media_type, self.where) as tar:
                extractor.apply(tar, layer.digest)
            reader.finish(layer.digest, layer.size, self.where)
        except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
            raise TransientError(f"{self.where}: layer {layer.digest} stream broke: {type(exc).__name__}") from exc
        except corrupt_stream_errors() as exc:
            raise IntegrityError(f"{self.where}: layer {layer.digest} is not a valid tar stream ({exc})") from exc
        finally:
            resp.close()

    def _write_blob(self, layer: Layer, staging_dir: str, on_bytes: Callable[[int], None]) -> None:
        rel = safe_relpath(layer.title or "", self.where)
        dest = os.path.join(staging_dir, *rel.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        resp = self.client.blob(layer.digest)
        try:
            reader = DigestReader(resp.raw, on_bytes)
            with open(dest, "wb") as out:
                while chunk := reader.read(_READ_CHUNK):
                    out.write(chunk)
            reader.finish(layer.digest, layer.size, self.where)
        finally:
            resp.close()

    def close(self) -> None:
        self.client.close()
        self.pool.clear()
