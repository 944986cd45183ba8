"""Google Cloud Storage (``gs://bucket/prefix``) through google-cloud-storage.

The SDK lists and authenticates; bytes come from ranged media GETs through the one HTTP data
path (``httpread``) with the credentials' bearer token, pinned to the generation seen at
listing time (``generation=``), streamed into the engine's buffers without an intermediate
copy. The SDK's own ranged download buffers each range in memory, which a 32 MiB chunk per
stream cannot afford. Objects carry crc32c (and md5 unless composite) in their metadata.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import google.auth
import requests
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.auth.exceptions import DefaultCredentialsError, GoogleAuthError, TransportError
from google.auth.transport.requests import Request as GoogleAuthRequest
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    ModelcacheError,
    NotFoundError,
    RateLimitedError,
    SourceError,
    TransientError,
)
from modelcache.sources.base import Checksum, RangeStream, RemoteFile, Source
from modelcache.sources.credentials import GCSSettings, Settings
from modelcache.sources.httpread import Pool, make_pool, open_range
from modelcache.sources.integrity import safe_b64_to_hex
from modelcache.sources.objectstore import (
    CONNECTION_POOL,
    check_unique,
    nothing_found,
    quiet_sdk_logs,
    relpath_in,
    scope_of,
    single_object_path,
)
from modelcache.sources.ratelimit import retry_after
from modelcache.sources.uri import GCSLocation, Location, redact_uri

quiet_sdk_logs()

_SCOPES = ["https://www.googleapis.com/auth/devstorage.read_only"]
_PUBLIC_ENDPOINT = "https://storage.googleapis.com"


def load_credentials(cfg: GCSSettings, where: str) -> tuple[Any, str | None]:
    """Credentials and project, in KServe's order; anonymous when none exist (public buckets)."""
    if cfg.emulator_host:
        return AnonymousCredentials(), cfg.project
    try:
        if cfg.service_account_info is not None:
            from google.oauth2 import service_account

            creds = service_account.Credentials.from_service_account_info(
                dict(cfg.service_account_info), scopes=_SCOPES
            )
            return creds, cfg.project or creds.project_id
        if cfg.credentials_file:
            return _credentials_from_file(cfg.credentials_file), cfg.project
    except (DefaultCredentialsError, ValueError, KeyError, OSError):
        what = cfg.credentials_file or "the storage-spec service account"
        raise AuthError(
            f"cannot load Google credentials from {what} for {where}: it must be a service-account (or other "
            "google-auth) JSON key; fix GOOGLE_APPLICATION_CREDENTIALS or the secret"
        ) from None
    try:
        creds, project = google.auth.default(scopes=_SCOPES)
        return creds, cfg.project or project
    except DefaultCredentialsError:
        return AnonymousCredentials(), cfg.project


def _credentials_from_file(path: str) -> Any:
    """GOOGLE_APPLICATION_CREDENTIALS: a service-account key (the usual case, loaded as exactly
    that), else another google-auth type (workload identity federation, user credentials)."""
    with open(path, encoding="utf-8") as fh:
        info = json.load(fh)
    if not isinstance(info, dict):
        raise ValueError("not a JSON object")
    if info.get("type") == "service_account":
        from google.oauth2 import service_account

        creds = service_account.Credentials.from_service_account_info(info, scopes=_SCOPES)
        return creds
    with warnings.catch_warnings():
        # The file is the operator's own configuration, not untrusted input.
        warnings.simplefilter("ignore", DeprecationWarning)
        creds, _ = google.auth.load_credentials_from_file(path, scopes=_SCOPES)
    return creds


class GCSSource(Source):
    max_streams = CONNECTION_POOL

    def __init__(self, location: Location, settings: Settings) -> None:
        super().__init__(location, settings)
        assert isinstance(location, GCSLocation)
        self.loc = location
        self.cfg = settings.gcs
        self.endpoint = (self.cfg.emulator_host or self.cfg.endpoint or _PUBLIC_ENDPOINT).rstrip("/")
        self._creds: Any = None
        self._project: str | None = None
        self._client: storage.Client | None = None
        self._pool: Pool | None = None
        self._token_request: Any = None  # google-auth's transport, for token refreshes
        self._lock = threading.RLock()  # engine threads may make the first call concurrently

    def _credentials(self) -> Any:
        with self._lock:
            if self._creds is None:
                self._creds, self._project = load_credentials(self.cfg, self.loc.display)
            return self._creds

    @property
    def client(self) -> storage.Client:
        with self._lock:
            if self._client is None:
                creds = self._credentials()
                self._client = storage.Client(
                    project=self._project or "modelcache",  # listing objects needs no project; avoid a lookup
                    credentials=creds,
                    client_options={"api_endpoint": self.endpoint},
                )
            return self._client

    def pool(self) -> Pool:
        with self._lock:
            if self._pool is None:
                # verify=None: REQUESTS_CA_BUNDLE as for the SDK's listing (requests).
                self._pool = make_pool(None, self.max_streams, self.cfg.connect_timeout, self.cfg.read_timeout)
            return self._pool

    def _auth(self, url: str) -> dict[str, str]:
        """The Authorization header, the token refreshed when due (one refresh at a time)."""
        headers: dict[str, str] = {}
        with self._lock:
            creds = self._credentials()
            if isinstance(creds, AnonymousCredentials):
                return headers
            if self._token_request is None:
                self._token_request = GoogleAuthRequest()
            creds.before_request(self._token_request, "GET", url, headers)
        return headers

    # -- listing -------------------------------------------------------------------------

    def list_files(self) -> list[RemoteFile]:
        where = self.loc.display
        scope = scope_of(self.loc.prefix)
        retry = DEFAULT_RETRY.with_timeout(self.cfg.retry_deadline)
        timeout = (self.cfg.connect_timeout, self.cfg.read_timeout)
        files: list[RemoteFile] = []
        try:
            for blob in self.client.list_blobs(self.loc.bucket, prefix=scope.folder, retry=retry, timeout=timeout):
                rel = relpath_in(scope, blob.name, where)
                if rel is not None:
                    files.append(self._describe(rel, blob, self.settings.forgery_proof))
            if not files and scope.single is not None:
                blob = self.client.bucket(self.loc.bucket).get_blob(scope.single, retry=retry, timeout=timeout)
                if blob is not None:
                    files.append(self._describe(single_object_path(scope.single, where), blob,
                                                self.settings.forgery_proof))
        except Exception as exc:
            raise self._error(exc, where, listing=True) from None
        if not files:
            raise nothing_found(where, "GCS")
        check_unique((f.path for f in files), where)
        return sorted(files, key=lambda f: f.path)

    @staticmethod
    def _describe(rel: str, blob: Any, forgery_proof: bool = False) -> RemoteFile:
        checksums = []
        if crc := safe_b64_to_hex(blob.crc32c):
            checksums.append(Checksum("crc32c", crc))
        # crc32c is on every GCS object and proves the bytes at ~0.1 CPU-s/GiB; md5 (absent on
        # composite objects) would add ~1.2, so it is only the fallback, unless bytes may be forged
        # on purpose (peer transfer): whoever knows a file can make other bytes with its crc32c.
        if (not checksums or forgery_proof) and (md5 := safe_b64_to_hex(blob.md5_hash)):
            checksums.append(Checksum("md5", md5))
        generation = str(blob.generation) if blob.generation is not None else None
        meta = [("name", blob.name)]
        if generation:
            meta.append(("generation", generation))
        return RemoteFile(
            path=rel, size=int(blob.size or 0), version=generation, checksums=tuple(checksums), meta=tuple(meta)
        )

    # -- reads ---------------------------------------------------------------------------

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        name = file.meta_get("name") or file.path
        where = f"gs://{self.loc.bucket}/{name}"
        url = f"{self.endpoint}/download/storage/v1/b/{quote(self.loc.bucket, safe='')}/o/{quote(name, safe='')}"
        url += "?alt=media" + (f"&generation={file.meta_get('generation')}" if file.meta_get("generation") else "")
        try:
            private = self._auth(url)
        except Exception as exc:
            raise self._error(exc, where) from None
        # The generation pins the object; the sizes are checked all the same (cheap).
        return open_range(self.pool(), url, file, start, end, where, private=private,
                          errors=lambda resp: self._status_error(resp.status, where, file, resp.headers))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.clear()
            self._pool = None

    # -- errors --------------------------------------------------------------------------

    def _status_error(self, status: int, where: str, file: RemoteFile | None = None,
                      headers: Mapping[str, str] | None = None) -> ModelcacheError:
        if status == 401:
            return AuthError(f"GCS rejected the credentials for {where}: check GOOGLE_APPLICATION_CREDENTIALS")
        if status == 403:
            return AccessDeniedError(
                f"access denied to {where}: the service account needs storage.objects.get and storage.objects.list "
                f"on bucket '{self.loc.bucket}'"
            )
        if status == 404:
            gen = file.meta_get("generation") if file else ""
            return NotFoundError(
                f"GCS object {where} (generation {gen}) not found: it changed or was deleted since "
                "listing; run the pull again"
            )
        if status == 429:
            return RateLimitedError(f"GCS is throttling requests for {where}; retrying",
                                    retry_after(headers or {}))
        if status >= 500:
            return TransientError(f"GCS server error {status} for {where}")
        return SourceError(f"GCS error {status} for {where}")

    def _error(self, exc: BaseException, where: str, listing: bool = False) -> ModelcacheError:
        if isinstance(exc, ModelcacheError):
            return exc
        if isinstance(exc, gexc.RetryError) and exc.cause is not None:
            exc = exc.cause
        endpoint = redact_uri(self.endpoint)
        ssl_error = isinstance(exc, requests.exceptions.SSLError) or "SSL" in type(exc.__cause__ or exc).__name__
        if ssl_error:
            return SourceError(
                f"TLS handshake/verification failed with {endpoint} for {where}: install the endpoint's CA certificate "
                "(REQUESTS_CA_BUNDLE) or fix STORAGE_EMULATOR_HOST's scheme"
            )
        if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, TransportError)):
            return TransientError(
                f"cannot connect to GCS endpoint {endpoint} for {where}: check the network or STORAGE_EMULATOR_HOST"
            )
        anonymous = isinstance(self._creds, AnonymousCredentials) and not self.cfg.emulator_host
        refused = isinstance(exc, GoogleAuthError) or (
            isinstance(exc, gexc.GoogleAPICallError) and exc.code in (401, 403)
        )
        if anonymous and refused:  # on a 401 the SDK tries to refresh anonymous credentials, and cannot
            return AuthError(
                f"anonymous access to {where} was refused: no Google credentials were found and the bucket is not "
                "public; set GOOGLE_APPLICATION_CREDENTIALS (or the storage-spec secret's service account)"
            )
        if isinstance(exc, GoogleAuthError):  # token refresh failed: bad or revoked key
            return AuthError(
                f"Google authentication failed for {where} ({type(exc).__name__}): check the service-account key in "
                "GOOGLE_APPLICATION_CREDENTIALS (or the storage-spec secret)"
            )
        if isinstance(exc, gexc.NotFound) and listing:
            return NotFoundError(
                f"GCS bucket '{self.loc.bucket}' does not exist ({where}): check the bucket name and project"
            )
        if isinstance(exc, gexc.GoogleAPICallError) and exc.code is not None:
            return self._status_error(int(exc.code), where)
        return TransientError(f"GCS read error for {where}: {type(exc).__name__}")
