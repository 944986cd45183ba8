"""The distribution v2 registry HTTP API for one repository, with auth taken from oras.

oras loads credentials from the docker config (``KSERVE_OCI_DOCKER_CONFIG``) and runs the
Bearer token exchange; requests go out without oras's retry decorator (it sleeps minutes on a
refused connection), since the transfer engine owns retries. Every failure becomes one line
naming the URI.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import oras.provider
import requests
from requests.adapters import HTTPAdapter

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    IntegrityError,
    ModelcacheError,
    NotFoundError,
    RateLimitedError,
    SourceError,
    TransientError,
)
from modelcache.sources.httpread import Pool, open_range
from modelcache.sources.ratelimit import retry_after
from modelcache.sources.remote import RangeStream, RemoteFile

if TYPE_CHECKING:
    from modelcache.sources.credentials import Settings

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)


# Docker Hub's names for itself (image references, docker config keys) vs. its API host.
_DOCKER_HUB = {"docker.io", "index.docker.io", "registry-1.docker.io"}
DOCKER_HUB_API = "registry-1.docker.io"


def api_endpoint(registry: str, repository: str) -> tuple[str, str]:
    """Host and repository as the registry API wants them (``docker.io/x`` is ``library/x``)."""
    if registry in _DOCKER_HUB:
        return DOCKER_HUB_API, repository if "/" in repository else f"library/{repository}"
    return registry, repository


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
        same = host == registry or (host in _DOCKER_HUB and registry in _DOCKER_HUB)
        if not same or not isinstance(entry, dict):
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
        api_host, api_repo = api_endpoint(registry, repository)
        self.base = f"{'http' if self._insecure else 'https'}://{api_host}/v2/{api_repo}"

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
        if resp.status_code < 400:
            return
        errors = _error_codes(resp)
        resp.close()
        raise self._status_error(resp.status_code, resp.headers, errors, what)

    def _status_error(self, code: int, headers: Any, errors: list[str], what: str) -> ModelcacheError:
        if code == 401:
            return AuthError(
                f"{self.where}: unauthorized at {self.registry}; put credentials for it in the docker config "
                f"at {self._config_path} (KSERVE_OCI_DOCKER_CONFIG)"
            )
        if code == 403:
            return AccessDeniedError(
                f"{self.where}: access to {self.registry}/{self.repository} denied; check the credentials' permissions"
            )
        if code == 404:
            if "NAME_UNKNOWN" in errors:
                return NotFoundError(f"{self.where}: repository '{self.repository}' not found in {self.registry}")
            return NotFoundError(f"{self.where}: {what} not found in {self.registry}/{self.repository}")
        if code == 429:
            return RateLimitedError(
                f"{self.where}: rate-limited by registry {self.registry} (HTTP 429) fetching {what}",
                retry_after=retry_after(headers),
            )
        if code >= 500:
            return TransientError(f"{self.where}: registry error {code} fetching {what}")
        return SourceError(
            f"{self.where}: registry answered {code} fetching {what} ({', '.join(errors) or 'no detail'})"
        )

    def open_blob(self, pool: Pool, file: RemoteFile, digest: str, start: int, end: int | None,
                  where: str) -> RangeStream:
        """A range of a blob through the one HTTP data path: the registry's token to its own
        host only (a redirect to blob storage carries its own signature); a 401 is answered
        with the registry's challenge once."""
        url = f"{self.base}/blobs/{digest}"
        challenged: list[bool] = []

        def errors(resp: Any) -> ModelcacheError:
            if resp.status == 401 and not challenged and self._answer_challenge(resp):
                challenged.append(True)
                return _Challenged(where)
            try:
                body = json.loads(resp.read(64 << 10) or b"{}")
                codes = [str(e.get("code")) for e in body.get("errors", []) if isinstance(e, dict)]
            except (ValueError, AttributeError):
                codes = []
            return self._status_error(resp.status, resp.headers, codes, f"blob {digest}")

        for _ in range(2):
            try:
                return open_range(pool, url, file, start, end, where, private=dict(self._auth), errors=errors)
            except _Challenged:
                continue
        raise AssertionError("unreachable: a second 401 is an AuthError")

    # -- API --------------------------------------------------------------------------------

    def manifest(self, reference: str, what: str) -> tuple[dict[str, Any], str, str]:
        """GET a manifest; returns (parsed, sha256 digest of the exact bytes, media type)."""
        accept = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))
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


class _Challenged(ModelcacheError):
    """A 401 whose challenge was answered: the request goes again with the new credentials."""
