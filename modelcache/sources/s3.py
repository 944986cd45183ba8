"""S3 (``s3://bucket/prefix``) through boto3: listing, credentials and ranged GETs.

Listing is bounded by ``/`` (see ``objectstore``). Every listed object gets one HEAD (with
``ChecksumMode=ENABLED``), because the listing alone cannot tell which checksums are real:
an SSE-KMS object's ETag is not its MD5, a multipart ETag needs the part size (a second HEAD
with ``PartNumber=1``), and a multipart object's CRC is only a whole-file CRC when S3 says
``ChecksumType=FULL_OBJECT``. A full-object CRC32/CRC32C/SHA256 (boto3 >= 1.36 uploads with
CRC32 by default) is preferred over the ETag: MD5 costs ~1.2 CPU-s per GiB, CRC32 ~0.15.
Reads are pinned with ``If-Match`` (and the version id on versioned buckets) so an overwrite
during the download fails loudly instead of mixing bytes.

botocore lists, authenticates and signs; the bytes do not go through it: each GET is signed
(SigV4, in its headers) and read by the one HTTP data path (``httpread``). Through botocore's
response objects the bytes cost ~3 CPU-s per GiB on top of the checksum.

The client is botocore's own, not boto3's wrapper around it: ``import boto3`` also imports
s3transfer (and with it multiprocessing), which a pull never uses: ~0.04 CPU-s and ~40 modules
of the ~0.4 CPU-s of fixed cost an S3 pull pays beyond the same pull over HTTP (issue 28, see
docs/benchmarks.md). Credentials, region and configuration resolve the same way: boto3's
``Session`` only hands them to a botocore session.
"""

from __future__ import annotations

import math
import os
import re
import threading
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import botocore
import botocore.session
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    SSLError,
)

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
from modelcache.sources.credentials import S3Settings, Settings
from modelcache.sources.httpread import Pool, make_pool, open_range
from modelcache.sources.integrity import cryptographic, safe_b64_to_hex
from modelcache.sources.objectstore import (
    CONNECTION_POOL,
    check_unique,
    nothing_found,
    parallel_map,
    quiet_sdk_logs,
    relpath_in,
    scope_of,
    single_object_path,
)
from modelcache.sources.ranges import changed
from modelcache.sources.ratelimit import retry_after
from modelcache.sources.uri import Location, S3Location, redact_uri

quiet_sdk_logs()

_MD5_ETAG = re.compile(r"[0-9a-f]{32}")
_MULTIPART_ETAG = re.compile(r"([0-9a-f]{32})-(\d+)")
# HeadObject field -> modelcache hasher name (full-object additional checksums).
_FULL_OBJECT_CHECKSUMS = (("sha256", "ChecksumSHA256"), ("crc32c", "ChecksumCRC32C"), ("crc32", "ChecksumCRC32"))
_AUTH_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
}
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "503"}
_LEGACY_GLOBAL_ENDPOINT = "https://s3.amazonaws.com"
_XML_CODE = re.compile(r"<Code>([^<]{1,100})</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]{1,300})</Message>")
# A presigned URL's signature: dropped from the URL that botocore built, whose GETs are signed
# in their headers (moto's IAM checks, like IAM policies with conditions, want that form).
_PRESIGN_PARAMS = {"X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Date", "X-Amz-Expires", "X-Amz-SignedHeaders",
                   "X-Amz-Security-Token", "X-Amz-Signature", "AWSAccessKeyId", "Signature", "Expires"}


def make_client(cfg: S3Settings, pool: int) -> tuple[Any, Any]:
    """An S3 client configured the way KServe's initializer configures its boto3 client, and
    the credentials it signs with (None when anonymous)."""
    addressing = "virtual" if cfg.virtual_addressing else "auto"
    if cfg.endpoint_url == _LEGACY_GLOBAL_ENDPOINT and cfg.region and cfg.region != "us-east-1":
        addressing = "virtual"  # KServe: the legacy global endpoint needs virtual hosting outside us-east-1
    config = Config(
        signature_version=botocore.UNSIGNED if cfg.anonymous else None,
        s3={"addressing_style": addressing, "use_accelerate_endpoint": cfg.use_accelerate},
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
        max_pool_connections=pool,
    )
    # Explicit keys (env or storage spec) win; otherwise botocore's default chain (IRSA / web
    # identity, shared config, container and instance roles), as boto3.session.Session sets them.
    session = botocore.session.get_session()
    if cfg.has_static_keys:
        session.set_credentials(cfg.access_key_id, cfg.secret_access_key, cfg.session_token or None)
    if cfg.region:
        session.set_config_variable("region", cfg.region)
    if cfg.verify and cfg.ca_bundle and not os.path.isfile(cfg.ca_bundle):
        raise SourceError(
            f"Failed to find ca bundle file({cfg.ca_bundle}): AWS_CA_BUNDLE (or the storage spec's ca_bundle), "
            "else the CA bundle ConfigMap's cabundle.crt (CA_BUNDLE_CONFIGMAP_NAME), must be a PEM file mounted in "
            "the container; S3 needs it, other backends keep the default trust store"
        )
    if cfg.endpoint_url and not re.match(r"(?i)https?://", cfg.endpoint_url):
        # botocore's own refusal is a bare ValueError('Invalid endpoint: ...') naming no variable.
        shown = redact_uri(cfg.endpoint_url)
        raise SourceError(
            f"the S3 endpoint {shown!r} (AWS_ENDPOINT_URL, or the storage spec's endpoint_url) has no scheme: write "
            f"it as http://{shown} or https://{shown}"
        )
    verify: bool | str | None = False if not cfg.verify else (cfg.ca_bundle or None)
    client = session.create_client("s3", endpoint_url=cfg.endpoint_url, verify=verify, config=config)
    return client, None if cfg.anonymous else session.get_credentials()


class S3Source(Source):
    max_streams = CONNECTION_POOL

    def __init__(self, location: Location, settings: Settings) -> None:
        super().__init__(location, settings)
        assert isinstance(location, S3Location)
        self.loc = location
        self.cfg = settings.s3
        self._client: Any = None
        self._lock = threading.Lock()  # engine threads may make the first call concurrently
        self._credentials: Any = None
        self._pool: Pool | None = None
        self._urls: dict[tuple[str, str], str] = {}  # (key, version id) -> the object's GET URL

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                try:
                    self._client, self._credentials = make_client(self.cfg, CONNECTION_POOL)
                except BotoCoreError as exc:
                    raise self._error(exc, self.loc.display) from None
            return self._client

    # -- listing -------------------------------------------------------------------------

    def list_files(self) -> list[RemoteFile]:
        where = self.loc.display
        scope = scope_of(self.loc.prefix)
        found: list[tuple[str, str]] = []  # (relative path, key)
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.loc.bucket, Prefix=scope.folder)
            for page in pages:
                for obj in page.get("Contents", ()):
                    rel = relpath_in(scope, obj["Key"], where)
                    if rel is not None:
                        found.append((rel, obj["Key"]))
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, where) from None
        if not found and scope.single is not None:
            found = [(single_object_path(scope.single, where), scope.single)]
        if not found:
            raise nothing_found(where, "S3")
        check_unique((p for p, _ in found), where)
        files = parallel_map(lambda item: self._describe(*item), found)
        return sorted(files, key=lambda f: f.path)

    def _head(self, key: str, **extra: Any) -> dict[str, Any]:
        return self.client.head_object(Bucket=self.loc.bucket, Key=key, ChecksumMode="ENABLED", **extra)

    def _describe(self, rel: str, key: str) -> RemoteFile:
        where = f"s3://{self.loc.bucket}/{key}"
        try:
            head = self._head(key)
        except (ClientError, BotoCoreError) as exc:
            if _status(exc) == 404 and key == self.loc.prefix:
                raise nothing_found(self.loc.display, "S3") from None
            raise self._error(exc, where) from None
        size = int(head["ContentLength"])
        etag = str(head.get("ETag", "")).strip('"').lower()
        version_id = head.get("VersionId")
        if version_id == "null":
            version_id = None
        checksums = self._checksums(key, size, etag, head, where)
        meta = [("key", key), ("etag", etag)]
        if version_id:
            meta.append(("version_id", str(version_id)))
        return RemoteFile(
            path=rel,
            size=size,
            version=str(version_id) if version_id else (etag or None),
            checksums=tuple(checksums),
            meta=tuple(meta),
        )

    def _checksums(self, key: str, size: int, etag: str, head: dict[str, Any], where: str) -> list[Checksum]:
        out: list[Checksum] = []
        multipart = _MULTIPART_ETAG.fullmatch(etag)
        whole_ok = not multipart or head.get("ChecksumType") == "FULL_OBJECT"
        if head.get("ChecksumType") != "COMPOSITE" and whole_ok:
            for algo, name in _FULL_OBJECT_CHECKSUMS:
                value = head.get(name)
                if value and "-" not in value and (hexval := safe_b64_to_hex(value)):
                    out.append(Checksum(algo, hexval))
        # A full-object CRC/SHA already proves the bytes; MD5 would add ~1.2 CPU-s per GiB for nothing,
        # unless bytes may be forged on purpose (peer transfer): against that a CRC proves nothing.
        if out and (not self.settings.forgery_proof or any(cryptographic(c.algo) for c in out)):
            return out
        # The ETag is an MD5 only without SSE-KMS / SSE-C (their ETags are opaque).
        if head.get("ServerSideEncryption", "").startswith("aws:kms") or head.get("SSECustomerAlgorithm"):
            return out
        if _MD5_ETAG.fullmatch(etag):
            out.append(Checksum("md5", etag))
        elif multipart:
            parts = int(multipart.group(2))
            part_size = self._part_size(key, where)
            # Only uniform part sizes (every SDK's default) can be recomputed from the file.
            if part_size and parts == max(1, math.ceil(size / part_size)):
                # Value as S3 shows it and modelcache.sources.integrity's s3-etag hasher computes it: <md5 hex>-<parts>.
                out.append(Checksum("s3-etag", etag, (("part_size", str(part_size)), ("parts", str(parts)))))
        return out

    def _part_size(self, key: str, where: str) -> int | None:
        try:
            head = self._head(key, PartNumber=1)
        except ClientError:
            return None  # e.g. a store without part-level HEAD: verify with what we have
        except BotoCoreError as exc:
            raise self._error(exc, where) from None
        return int(head["ContentLength"]) or None

    # -- reads ---------------------------------------------------------------------------

    def _url(self, key: str, version_id: str) -> str:
        """The object's GET URL as botocore builds it (addressing style, accelerate, region
        endpoints), once per file: a presigned URL without its signature."""
        with self._lock:
            url = self._urls.get((key, version_id))
        if url is not None:
            return url
        params = {"Bucket": self.loc.bucket, "Key": key}
        if version_id:
            params["VersionId"] = version_id
        try:
            presigned = self.client.generate_presigned_url("get_object", Params=params, ExpiresIn=60)
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, f"s3://{self.loc.bucket}/{key}") from None
        parts = urlsplit(presigned)
        query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in _PRESIGN_PARAMS]
        url = urlunsplit(parts._replace(query=urlencode(query, quote_via=quote)))
        with self._lock:
            self._urls[(key, version_id)] = url
        return url

    def _sign(self, url: str) -> dict[str, str]:
        """SigV4 headers for one GET (signed per request: credentials that rotate, an IRSA
        session, are refreshed by botocore as for its own calls)."""
        if self._credentials is None:
            return {}
        request = AWSRequest(method="GET", url=url)
        S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3",
                    self.client.meta.region_name or "us-east-1").add_auth(request)
        return dict(request.headers.items())

    def pool(self) -> Pool:
        with self._lock:
            if self._pool is None:
                cfg = self.cfg
                self._pool = make_pool(cfg.ca_bundle or True if cfg.verify else False, self.max_streams,
                                       cfg.connect_timeout, cfg.read_timeout)
            return self._pool

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        key = file.meta_get("key") or file.path
        where = f"s3://{self.loc.bucket}/{key}"
        listed = file.meta_get("etag")
        headers = {"If-Match": f'"{listed}"'} if listed else {}

        def check(resp: Any) -> None:  # S3-compatible stores do not all honour If-Match
            etag = str(resp.headers.get("ETag", "")).strip('"').lower()
            if listed and etag and etag != listed:
                raise changed(where, f"its ETag is now {etag}, listed {listed}")

        url = self._url(key, file.meta_get("version_id"))
        # Range and If-Match go unsigned (SigV4 allows that for standard headers).
        return open_range(self.pool(), url, file, start, end, where, headers={**self._sign(url), **headers},
                          errors=lambda resp: self._response_error(resp, where), check=check)

    def _response_error(self, resp: Any, where: str) -> ModelcacheError:
        """A failed GET: S3's error code from its XML body, worded as for the SDK's calls."""
        try:
            body = resp.read(64 << 10, decode_content=True) if resp.status < 500 or resp.status == 503 else b""
        except Exception:
            body = b""
        code = _XML_CODE.search(body.decode("utf-8", "replace"))
        message = _XML_MESSAGE.search(body.decode("utf-8", "replace"))
        err = self._code_error(code.group(1) if code else "", resp.status,
                               message.group(1) if message else "", where)
        if isinstance(err, RateLimitedError):
            err.retry_after = retry_after(resp.headers)
        return err

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._pool is not None:
            self._pool.clear()
            self._pool = None

    # -- errors --------------------------------------------------------------------------

    def _endpoint(self) -> str:
        return redact_uri(self.cfg.endpoint_url) if self.cfg.endpoint_url else "the AWS S3 endpoint"

    def _error(self, exc: BaseException, where: str, reading: bool = False) -> ModelcacheError:
        """One line per failure kind: what failed, for which URI, and what to change."""
        if isinstance(exc, ModelcacheError):
            return exc
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            how = (f"check {self.settings.credentials_from}" if self.settings.credentials_from else
                   "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the storage-spec secret)")
            return AuthError(
                f"{where}: no AWS credentials: {how}, use IRSA, or awsAnonymousCredential=true for a public bucket"
            )
        if isinstance(exc, SSLError):
            return SourceError(
                f"TLS handshake/verification failed with {self._endpoint()} for {where}: set AWS_CA_BUNDLE to the "
                "endpoint's CA certificate (or S3_VERIFY_SSL=0 for a test endpoint), or check S3_USE_HTTPS"
            )
        if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError)):
            return TransientError(
                f"cannot connect to S3 endpoint {self._endpoint()} for {where}: check AWS_ENDPOINT_URL / "
                "S3_ENDPOINT, the region and the network"
            )
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            return self._code_error(str(err.get("Code", "")), _status(exc), str(err.get("Message", "")), where)
        if isinstance(exc, BotoCoreError):
            # Read timeouts, dropped streams, incomplete reads: retryable.
            return TransientError(f"S3 transfer error for {where}: {type(exc).__name__}")
        return (
            TransientError(f"S3 read error for {where}: {type(exc).__name__}")
            if reading
            else SourceError(f"S3 error for {where}: {type(exc).__name__}")
        )


    def _code_error(self, code: str, status: int, message: str, where: str) -> ModelcacheError:
        """An S3 error code (from the SDK or a GET's XML body) as one line."""
        bucket = self.loc.bucket
        if code in _AUTH_CODES:
            how = self.settings.credentials_hint(
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (or the storage-spec secret)")
            return AuthError(f"S3 rejected the credentials for {where} ({code}): {how} and the region")
        if code == "NoSuchBucket":
            return NotFoundError(
                f"S3 bucket '{bucket}' does not exist ({where}): check the bucket name, the endpoint "
                f"({self._endpoint()}) and the region"
            )
        if self.cfg.anonymous and (code == "AccessDenied" or status in (401, 403)):
            return AccessDeniedError(
                f"anonymous access (awsAnonymousCredential=true) to {where} was refused: the bucket is not "
                "public; unset awsAnonymousCredential and provide AWS credentials"
            )
        if code in ("AccessDenied", "AllAccessDisabled", "AccountProblem") or status == 403:
            return AccessDeniedError(
                f"access denied to {where} ({code or 403}): the credentials need s3:ListBucket on bucket "
                f"'{bucket}' and s3:GetObject on its objects"
            )
        if code in ("PreconditionFailed",) or status == 412:
            return SourceChangedError(
                f"{where} changed while it was being downloaded (ETag no longer matches); run the pull again"
            )
        if code in ("NoSuchKey", "NoSuchVersion", "404") or status == 404:
            return NotFoundError(f"S3 object {where} not found (deleted or replaced since listing?)")
        if code in _THROTTLE_CODES or status in (429, 503):
            return RateLimitedError(f"S3 is throttling requests for {where} ({code}); retrying")
        if status >= 500 or code in ("InternalError", "RequestTimeout"):
            return TransientError(f"S3 server error for {where} ({code or status})")
        return SourceError(f"S3 error for {where}: {code or status} {message}".rstrip())


def _status(exc: BaseException) -> int:
    if isinstance(exc, ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return 0


