"""Azure Blob (``https://<account>.blob.core.windows.net/<container>/<prefix>``) through
azure-storage-blob.

Credentials follow KServe's order: an Azure AD identity when ``AZURE_CLIENT_ID`` is set (legacy
``AZ_*`` names already mapped by ``credentials``), else the account key, else anonymous; a SAS
query string on the URI is kept on the account URL. The identity is built from our settings
(client secret, workload identity, managed identity: the parts of DefaultAzureCredential that
apply in a pod) rather than DefaultAzureCredential itself, which would read the process
environment instead of the settings the caller passed. Reads are pinned to the ETag seen at
listing time with If-Match.

The SDK lists and authenticates; the bytes come through the one HTTP data path (``httpread``):
a GET per range with the URI's SAS, a read-only SAS made from the account key, or the
identity's bearer token (the SDK's downloader buffers and copies every chunk).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any
from urllib.parse import quote

from azure.core.credentials import AccessToken
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.core.pipeline.transport import RequestsTransport
from azure.storage.blob import BlobSasPermissions, BlobServiceClient, generate_blob_sas

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    ModelcacheError,
    NotFoundError,
    RateLimitedError,
    SourceChangedError,
    SourceError,
    TransientError,
)
from modelcache.sources.base import Checksum, RangeStream, RemoteFile, Source
from modelcache.sources.credentials import AzureSettings, Settings
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
from modelcache.sources.uri import AzureBlobLocation, Location

quiet_sdk_logs()

# The SDK's HTTP logging prints request URLs and headers; keep it quiet whatever the root level.
logging.getLogger("azure.core.pipeline.policies.http_logging_policy").setLevel(logging.WARNING)
# azure.identity warns on stderr for every failed token request; our one-line error says it all.
logging.getLogger("azure.identity").setLevel(logging.ERROR)

# Each SDK GET is buffered whole; keep the buffers small so many streams stay within memory.
_GET_SIZE = 8 << 20
_STORAGE_SCOPE = "https://storage.azure.com/.default"
_SAS_LIFETIME = 3600  # seconds a read SAS made from the account key is valid
_RENEW_BEFORE = 600  # a SAS or token this close to its expiry is renewed before a read
_AUTH_CODES = {"AuthenticationFailed", "NoAuthenticationInformation", "InvalidAuthenticationInfo"}
_DENIED_CODES = {
    "AuthorizationPermissionMismatch",
    "AuthorizationFailure",
    "AuthorizationResourceTypeMismatch",
    "AuthorizationSourceIPMismatch",
    "AuthorizationProtocolMismatch",
    "InsufficientAccountPermissions",
}


class _StaticToken:
    """AZURE_ACCESS_TOKEN: a bearer token handed over as is (no refresh possible)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken(self._token, int(time.time()) + 3600)


def _pooled_transport(cfg: AzureSettings) -> RequestsTransport:
    """The SDK's requests transport with a connection pool sized for many parallel reads (its
    default of 10 makes urllib3 discard connections and warn once the engine runs more)."""
    import requests
    from azure.core.pipeline.transport._bigger_block_size_http_adapters import BiggerBlockSizeHTTPAdapter
    from urllib3.util.retry import Retry

    session = requests.Session()
    session.trust_env = True  # proxies from HTTPS_PROXY / NO_PROXY, as the SDK's default
    adapter = BiggerBlockSizeHTTPAdapter(
        max_retries=Retry(total=False, redirect=False, raise_on_status=False), pool_maxsize=CONNECTION_POOL
    )
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return RequestsTransport(
        session=session,
        session_owner=True,
        connection_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
    )


def _well_known_authority(authority: str) -> bool:
    from urllib.parse import urlsplit

    from msal.authority import WELL_KNOWN_AUTHORITY_HOSTS

    host = urlsplit(authority if "://" in authority else f"https://{authority}").hostname or ""
    return host in WELL_KNOWN_AUTHORITY_HOSTS


def make_credential(cfg: AzureSettings, account: str) -> Any:
    if cfg.use_default_credential:
        from azure import identity

        extra: dict[str, Any] = {}
        if cfg.authority_host:
            extra["authority"] = cfg.authority_host
            # MSAL validates an authority it does not know (Azure Stack, a private or test token
            # endpoint) through login.microsoftonline.com, which such a network cannot reach.
            if not _well_known_authority(cfg.authority_host):
                extra["disable_instance_discovery"] = True
        if cfg.client_secret and cfg.tenant_id:
            return identity.ClientSecretCredential(cfg.tenant_id, str(cfg.client_id), cfg.client_secret, **extra)
        if cfg.federated_token_file and cfg.tenant_id:
            return identity.WorkloadIdentityCredential(
                tenant_id=cfg.tenant_id, client_id=cfg.client_id, token_file_path=cfg.federated_token_file, **extra
            )
        return identity.ManagedIdentityCredential(client_id=cfg.client_id)
    if cfg.access_key:
        return {"account_name": account, "account_key": cfg.access_key}
    if cfg.access_token:
        return _StaticToken(cfg.access_token)
    return None  # a SAS in the URL, or a public container


class AzureBlobSource(Source):
    max_streams = CONNECTION_POOL

    def __init__(self, location: Location, settings: Settings) -> None:
        super().__init__(location, settings)
        assert isinstance(location, AzureBlobLocation)
        self.loc = location
        self.cfg = settings.azure
        if self.cfg.endpoint_template:
            base = self.cfg.endpoint_template.format(account=location.account).rstrip("/")
            self.account_url = base + (f"?{location.sas}" if location.sas else "")
            self.endpoint = base
        else:
            self.account_url = location.account_url
            self.endpoint = location.account_url.split("?", 1)[0]
        self._service: BlobServiceClient | None = None
        self._credential: Any = None
        self._lock = threading.Lock()  # engine threads may make the first call concurrently
        self._pool: Pool | None = None
        self._read_auth: dict[str, tuple[str, float]] = {}  # blob name (or "" for a token) -> (auth, until)

    @property
    def container(self) -> Any:
        with self._lock:
            return self._service_client().get_container_client(self.loc.container)

    def _service_client(self) -> BlobServiceClient:
        if self._service is None:
            try:
                self._credential = make_credential(self.cfg, self.loc.account)
            except Exception as exc:
                raise self._error(exc, self.loc.display) from None
            self._service = BlobServiceClient(
                self.account_url,
                credential=self._credential,
                transport=_pooled_transport(self.cfg),
                max_single_get_size=_GET_SIZE,
                max_chunk_get_size=_GET_SIZE,
                retry_total=self.cfg.retry_total,
                retry_backoff_factor=0.4,
            )
        return self._service

    @property
    def resolved_uri(self) -> str:
        """Never the raw URI: it may carry a SAS token (and a renewed SAS must not defeat resume)."""
        return self._resolved or self.loc.display

    # -- listing -------------------------------------------------------------------------

    def list_files(self) -> list[RemoteFile]:
        where = self.loc.display
        scope = scope_of(self.loc.prefix)
        container = self.container
        files: list[RemoteFile] = []
        try:
            for blob in container.list_blobs(name_starts_with=scope.folder or None, include=["metadata"]):
                if (blob.metadata or {}).get("hdi_isfolder") == "true":
                    continue  # ADLS Gen2 directory entry
                rel = relpath_in(scope, blob.name, where)
                if rel is not None:
                    files.append(self._describe(rel, blob))
            if not files and scope.single is not None:
                try:
                    blob = container.get_blob_client(scope.single).get_blob_properties()
                except ResourceNotFoundError as exc:
                    if getattr(exc, "error_code", None) == "ContainerNotFound":
                        raise
                else:
                    files.append(self._describe(single_object_path(scope.single, where), blob))
        except Exception as exc:
            raise self._error(exc, where) from None
        if not files:
            raise nothing_found(where, "Azure Blob")
        check_unique((f.path for f in files), where)
        return sorted(files, key=lambda f: f.path)

    @staticmethod
    def _describe(rel: str, blob: Any) -> RemoteFile:
        checksums = []
        settings = getattr(blob, "content_settings", None)
        if settings is not None and (md5 := safe_b64_to_hex(settings.content_md5)):
            checksums.append(Checksum("md5", md5))
        etag = str(blob.etag or "").strip('"') or None
        meta = [("name", blob.name)]
        if etag:
            meta.append(("etag", etag))
        return RemoteFile(
            path=rel, size=int(blob.size or 0), version=etag, checksums=tuple(checksums), meta=tuple(meta)
        )

    # -- reads ---------------------------------------------------------------------------

    def pool(self) -> Pool:
        with self._lock:
            if self._pool is None:
                # verify=None: REQUESTS_CA_BUNDLE as for the SDK's listing (requests).
                self._pool = make_pool(None, self.max_streams, self.cfg.connect_timeout, self.cfg.read_timeout)
            return self._pool

    def _authorize(self, name: str, url: str) -> tuple[str, dict[str, str]]:
        """The blob's GET URL and the headers that authorise it, by the listing's credentials:
        the URI's SAS, a read-only SAS from the account key (one per blob, renewed every few
        minutes), the identity's bearer token, or nothing for a public container."""
        with self._lock:
            service = self._service_client()
            headers = {"x-ms-version": service.api_version}
            cred = self._credential
            if self.loc.sas:
                return f"{url}?{self.loc.sas}", headers
            now = time.time()
            if isinstance(cred, dict):  # account name + key
                sas, until = self._read_auth.get(name, ("", 0.0))
                if until - now < _RENEW_BEFORE:
                    expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=_SAS_LIFETIME)
                    sas = generate_blob_sas(self.loc.account, self.loc.container, name, account_key=cred["account_key"],
                                            permission=BlobSasPermissions(read=True), expiry=expiry)
                    self._read_auth[name] = (sas, now + _SAS_LIFETIME)
                return f"{url}?{sas}", headers
            if cred is not None and hasattr(cred, "get_token"):
                token, until = self._read_auth.get("", ("", 0.0))
                if until - now < _RENEW_BEFORE:
                    got = cred.get_token(_STORAGE_SCOPE)
                    token, until = got.token, float(got.expires_on)
                    self._read_auth[""] = (token, until)
                return url, {**headers, "Authorization": f"Bearer {token}"}
            return url, headers

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        name = file.meta_get("name") or file.path
        where = f"blob '{name}' of {self.loc.display}"
        try:
            url, auth = self._authorize(name, f"{self.endpoint}/{quote(self.loc.container)}/{quote(name)}")
        except Exception as exc:
            raise self._error(exc, where) from None
        headers = {"If-Match": f'"{file.meta_get("etag")}"'} if file.meta_get("etag") else {}
        return open_range(self.pool(), url, file, start, end, where, headers=headers, private=auth,
                          errors=lambda resp: self._error(_Failed(resp), where))

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
            self._service = None
        if self._pool is not None:
            self._pool.clear()
            self._pool = None

    # -- errors --------------------------------------------------------------------------

    def _error(self, exc: BaseException, where: str) -> ModelcacheError:
        if isinstance(exc, ModelcacheError):
            return exc
        raw_code = getattr(exc, "error_code", "") or ""
        code = str(getattr(raw_code, "value", raw_code))
        status = int(getattr(getattr(exc, "response", None), "status_code", 0) or getattr(exc, "status_code", 0) or 0)
        account = self.loc.account
        if isinstance(exc, ServiceRequestError):
            inner = exc.inner_exception or exc.__cause__
            if "SSL" in type(inner).__name__ or "SSL" in repr(inner)[:200] or "CERTIFICATE" in repr(inner)[:200]:
                return SourceError(
                    f"TLS handshake/verification failed with {self.endpoint} for {where}: install the endpoint's CA "
                    "certificate (REQUESTS_CA_BUNDLE) or check the account URL"
                )
            return TransientError(
                f"cannot connect to Azure Blob endpoint {self.endpoint} for {where}: check the account name, "
                "private endpoint / DNS and the network"
            )
        if isinstance(exc, ServiceResponseError):
            return TransientError(f"Azure Blob connection error for {where}: {type(exc).__name__}")
        anonymous = not (
            self.cfg.use_default_credential or self.cfg.access_key or self.cfg.access_token or self.loc.sas
        )
        # Azure hides private containers from anonymous callers behind a plain 404 ResourceNotFound.
        hidden = status == 404 and code == "ResourceNotFound"
        if anonymous and (status in (401, 403) or hidden or code in _AUTH_CODES or code in _DENIED_CODES):
            return AuthError(
                f"anonymous access to {where} was refused ({code or status}): the container is not public; set "
                "AZURE_STORAGE_ACCESS_KEY, AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or add a SAS to the URI"
            )
        if (
            self.cfg.use_default_credential
            and not code
            and (isinstance(exc, ClientAuthenticationError) or type(exc).__module__.startswith("azure.identity"))
        ):
            # The token request itself failed (raised by azure.identity, no storage error code).
            return AuthError(
                f"Azure AD refused or could not issue a token for {where} (client id {self.cfg.client_id}): check "
                "AZURE_CLIENT_ID, AZURE_TENANT_ID and AZURE_CLIENT_SECRET (or AZURE_FEDERATED_TOKEN_FILE), and "
                "AZURE_AUTHORITY_HOST"
            )
        # Azurite (and Azure behind a firewall) answer a wrong account key with AuthorizationFailure.
        key_refused = (
            code == "AuthorizationFailure" and bool(self.cfg.access_key) and not self.cfg.use_default_credential
        )
        if (
            code in _AUTH_CODES
            or key_refused
            or (isinstance(exc, ClientAuthenticationError) and code not in _DENIED_CODES)
        ):
            return AuthError(
                f"Azure rejected the credentials for {where} ({code or type(exc).__name__}): check "
                "AZURE_STORAGE_ACCESS_KEY, the AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET service principal, "
                "or the SAS token (expiry, signature); or the account's network rules block this client"
            )
        if code in _DENIED_CODES or status == 403:
            return AccessDeniedError(
                f"access denied to {where} ({code or 403}): the identity needs the 'Storage Blob Data Reader' role "
                f"on container '{self.loc.container}' of account '{account}' (or a SAS with read and list permission)"
            )
        if code == "ContainerNotFound":
            return NotFoundError(
                f"Azure container '{self.loc.container}' does not exist in storage account '{account}' ({where}): "
                "check the container name in the URI"
            )
        if isinstance(exc, ResourceModifiedError) or code == "ConditionNotMet" or status == 412:
            return SourceChangedError(
                f"{where} changed while it was being downloaded (ETag no longer matches); run again"
            )
        if isinstance(exc, ResourceNotFoundError) or status == 404:
            return NotFoundError(f"Azure blob {where} not found (deleted since listing?)")
        if status in (429, 503) or code == "ServerBusy":
            return RateLimitedError(f"Azure Blob is throttling requests for {where}; retrying",
                                    retry_after(exc.headers) if isinstance(exc, _Failed) else None)
        if isinstance(exc, HttpResponseError) and status >= 500:
            return TransientError(f"Azure Blob server error {status} for {where}")
        if isinstance(exc, HttpResponseError):
            return SourceError(f"Azure Blob error for {where}: {code or status}")
        if isinstance(exc, ValueError) and "HTTPS" in str(exc):
            return SourceError(
                f"Azure AD credentials (AZURE_CLIENT_ID) need an https:// account URL, not {self.endpoint}, for {where}"
            )
        if type(exc).__module__.startswith("azure.identity") or "Credential" in type(exc).__name__:
            return AuthError(
                f"cannot get an Azure AD token for {where} ({type(exc).__name__}): check AZURE_CLIENT_ID, "
                "AZURE_TENANT_ID and AZURE_CLIENT_SECRET (or the workload identity)"
            )
        return TransientError(f"Azure Blob error for {where}: {type(exc).__name__}")


class _Failed(HttpResponseError):
    """A failed GET of the data path, as the SDK's error it would have raised (status and
    ``x-ms-error-code``), for the one mapping in ``AzureBlobSource._error``."""

    def __init__(self, resp: Any) -> None:
        Exception.__init__(self, f"HTTP {resp.status}")
        self.status_code = resp.status
        self.error_code = resp.headers.get("x-ms-error-code") or None
        self.headers = dict(resp.headers)
        self.response = None
        self.reason = None
        self.message = f"HTTP {resp.status}"
