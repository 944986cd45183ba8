"""OCI registries: ``oci://registry/repository[:tag|@sha256:digest]`` (also ``oci+fetch://`` etc.).

The reference is resolved to a manifest digest once; every later read is by digest, so a tag
moved during a pull cannot mix two versions. Two layouts are understood:

* an ORAS artifact: one blob per file, named by the ``org.opencontainers.image.title``
  annotation. ``list_files`` gives one RemoteFile per blob (sha256 checksum) and the transfer
  engine reads them by ranged blob GETs, in parallel chunks.
* a KServe "modelcar" image: tar layers holding ``/models/...``. ``extract_into`` streams the
  layers, verifies each digest and unpacks only ``models/`` (see ``oci_layers``). ORAS
  directory layers (``io.deis.oras.content.unpack``) take the same path.

The registry protocol and auth come from oras: its docker-config loader finds credentials
(``KSERVE_OCI_DOCKER_CONFIG``) and its token backend answers Bearer challenges. Requests go out
without oras's retry decorator (it sleeps minutes on a refused connection); the transfer engine
owns retries.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import oras.provider
import requests
import urllib3
from requests.adapters import HTTPAdapter

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    IntegrityError,
    NotFoundError,
    RateLimitedError,
    SourceError,
    TransientError,
    UnsupportedError,
)
from modelcache.sources.base import Checksum, RangeStream, RemoteFile, Source, register_source, safe_relpath
from modelcache.sources.oci_layers import DigestReader, LayerExtractor, corrupt_stream_errors, open_layer_tar
from modelcache.sources.response_stream import ResponseStream
from modelcache.uri import OCILocation

if TYPE_CHECKING:
    from modelcache.credentials import Settings

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
_INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
_MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
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


def docker_config_credentials(path: str, registry: str) -> tuple[str, str] | None:
    """Credentials for ``registry`` in a docker config, for the entries oras matches only by
    bare host name: keys written as URLs (``https://host/v1/``) and ``username``/``password``
    fields instead of ``auth``."""
    try:
        with open(path, encoding="utf-8") as f:
            auths = (json.load(f) or {}).get("auths") or {}
    except (OSError, ValueError, AttributeError):
        return None
    for key, entry in auths.items():
        host = urlsplit(key).netloc if "://" in key else key.split("/")[0]
        if host != registry or not isinstance(entry, dict):
            continue
        if entry.get("auth"):
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return None
            return user, password
        if entry.get("username") and entry.get("password"):
            return str(entry["username"]), str(entry["password"])
    return None


class RegistryClient:
    """The distribution v2 HTTP API for one repository, with auth taken from oras."""

    def __init__(self, registry: str, repository: str, settings: Settings, where: str) -> None:
        self.registry = registry
        self.repository = repository
        self.where = where
        self._config_path = settings.oci.docker_config
        self._insecure = settings.oci.insecure
        self._oras = oras.provider.Registry(hostname=registry, insecure=settings.oci.insecure, auth_backend="token")
        configs = [self._config_path] if os.path.isfile(self._config_path) else []
        self._oras.auth.load_configs(self._oras.get_container(f"{registry}/{repository}"), configs=configs)
        if not getattr(self._oras.auth, "_basic_auth", None) and configs:
            creds = docker_config_credentials(self._config_path, registry)
            if creds:
                self._oras.auth.set_basic_auth(*creds)
        self._session: requests.Session = self._oras.session
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=32)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._verify: bool | str = settings.http.ca_bundle or True
        self._timeout = (settings.http.connect_timeout, settings.http.read_timeout)
        self._auth: dict[str, str] = {}
        self.base = f"{'http' if self._insecure else 'https'}://{registry}/v2/{repository}"

    # -- requests ---------------------------------------------------------------------------

    def request(
        self, method: str, url: str, headers: dict[str, str] | None = None, stream: bool = False
    ) -> requests.Response:
        """One request; on a 401 answer the registry's challenge once (Basic or Bearer)."""
        for attempt in range(2):
            try:
                resp = self._session.request(
                    method,
                    url,
                    headers={**(headers or {}), **self._auth},
                    stream=stream,
                    verify=self._verify,
                    timeout=self._timeout,
                    allow_redirects=True,
                )
            except requests.exceptions.SSLError as exc:
                hint = "" if self._insecure else " (a plain-http registry needs KSERVE_OCI_INSECURE_REGISTRY=true)"
                raise SourceError(f"{self.where}: TLS handshake with {self.registry} failed{hint}") from exc
            except (requests.ConnectionError, requests.Timeout) as exc:
                raise TransientError(
                    f"{self.where}: cannot reach registry {self.registry}: {type(exc).__name__}"
                ) from exc
            if resp.status_code != 401 or attempt == 1 or not self._answer_challenge(resp):
                return resp
            resp.close()
        raise AssertionError("unreachable")

    def _answer_challenge(self, resp: requests.Response) -> bool:
        challenge = resp.headers.get("Www-Authenticate", "")
        auth = self._oras.auth
        if challenge.lower().startswith("basic"):
            basic = getattr(auth, "_basic_auth", None)
            if basic and self._auth.get("Authorization") != f"Basic {basic}":
                self._auth = {"Authorization": f"Basic {basic}"}
                return True
            return False
        if challenge.lower().startswith("bearer"):
            try:
                headers, changed = auth.authenticate_request(resp, {}, refresh=bool(self._auth))
            except requests.RequestException as exc:
                raise TransientError(
                    f"{self.where}: token request to the registry failed: {type(exc).__name__}"
                ) from exc
            if changed and headers.get("Authorization"):
                self._auth = {"Authorization": headers["Authorization"]}
                return True
        return False

    def check(self, resp: requests.Response, what: str) -> None:
        """Map a failed response to one clear error line."""
        code = resp.status_code
        if code < 400:
            return
        errors = _error_codes(resp)
        resp.close()
        if code == 401:
            raise AuthError(
                f"{self.where}: unauthorized at {self.registry}; put credentials for it in the docker config "
                f"at {self._config_path} (KSERVE_OCI_DOCKER_CONFIG)"
            )
        if code == 403:
            raise AccessDeniedError(
                f"{self.where}: access to {self.registry}/{self.repository} denied; check the credentials' permissions"
            )
        if code == 404:
            if "NAME_UNKNOWN" in errors:
                raise NotFoundError(f"{self.where}: repository '{self.repository}' not found in {self.registry}")
            raise NotFoundError(f"{self.where}: {what} not found in {self.registry}/{self.repository}")
        if code == 429:
            retry = resp.headers.get("Retry-After")
            raise RateLimitedError(
                f"{self.where}: registry rate limit (429)",
                retry_after=float(retry) if retry and retry.isdigit() else None,
            )
        if code >= 500:
            raise TransientError(f"{self.where}: registry error {code} fetching {what}")
        raise SourceError(
            f"{self.where}: registry answered {code} fetching {what} ({', '.join(errors) or 'no detail'})"
        )

    # -- API --------------------------------------------------------------------------------

    def manifest(self, reference: str, what: str) -> tuple[dict[str, Any], str, str]:
        """GET a manifest; returns (parsed, sha256 digest of the exact bytes, media type)."""
        accept = ", ".join((*_MANIFEST_TYPES, *_INDEX_TYPES))
        resp = self.request("GET", f"{self.base}/manifests/{reference}", headers={"Accept": accept})
        self.check(resp, what)
        body = resp.content
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise IntegrityError(f"{self.where}: manifest {reference} failed verification (got {digest})")
        try:
            doc = json.loads(body)
        except json.JSONDecodeError as exc:
            raise SourceError(f"{self.where}: {what} is not a JSON manifest") from exc
        media_type = doc.get("mediaType") or resp.headers.get("Content-Type", "").split(";")[0].strip()
        return doc, digest, media_type

    def blob(self, digest: str, start: int = 0, end: int | None = None) -> requests.Response:
        headers = {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        resp = self.request("GET", f"{self.base}/blobs/{digest}", headers=headers, stream=True)
        self.check(resp, f"blob {digest}")
        return resp

    def close(self) -> None:
        self._session.close()


def _error_codes(resp: requests.Response) -> list[str]:
    try:
        return [str(e.get("code")) for e in resp.json().get("errors", []) if isinstance(e, dict)]
    except (ValueError, AttributeError):
        return []


@register_source("oci")
class OCISource(Source):
    preferred_chunk_size = 16 << 20
    max_streams = 8

    def __init__(self, location: OCILocation, settings: Settings) -> None:  # type: ignore[override]
        super().__init__(location, settings)
        self.loc = location
        self.where = location.display
        self.client = RegistryClient(location.registry, location.repository, settings, self.where)
        self._plan: Plan | None = None

    # -- resolution -------------------------------------------------------------------------

    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = self._resolve()
            self._resolved = f"oci://{self.loc.registry}/{self.loc.repository}@{self._plan.digest}"
        return self._plan

    def _resolve(self) -> Plan:
        ref = self.loc.reference
        what = f"digest {ref}" if self.loc.digest else f"tag '{ref}'"
        doc, digest, media_type = self.client.manifest(ref, what)
        if media_type in _INDEX_TYPES or ("manifests" in doc and "layers" not in doc):
            child = self._pick_platform(doc)
            doc, _, media_type = self.client.manifest(child, f"manifest {child}")
        if media_type not in _MANIFEST_TYPES and "layers" not in doc:
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
        resp = self.client.blob(digest, start, end)
        skip = start if resp.status_code == 200 else 0  # a registry that ignored the Range
        stop = end if end is not None else file.size
        length = None if stop is None else stop - start
        return ResponseStream(resp.raw, f"{self.where}: {file.path}", length, skip, on_close=resp.close)

    def extract_into(self, staging_dir: str, on_bytes: Callable[[int], None]) -> list[str] | None:
        plan = self.plan()
        if plan.layout == "artifact":
            return None
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
            with open_layer_tar(reader, layer.media_type, self.where) as tar:
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
