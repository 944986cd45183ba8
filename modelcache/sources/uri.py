"""Storage URIs: parse every scheme modelcache accepts into a typed location.

The raw string is kept on every location because KServe derives on-disk names from it byte
for byte (``storage_key``). Parsing is a registry of location kinds tried in KServe's dispatch
order (Azure hosts before generic HTTPS), so a new backend is one class and one decorator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Self
from urllib.parse import SplitResult, unquote, urlsplit

from modelcache.errors import InvalidURIError, UnsupportedError
from modelcache.runtime.redact import DIGEST_PIN, printable, redact_uri, scrub_parts, secret_parts, split_userinfo

__all__ = ["Location", "parse_uri", "redact_uri", "register_location", "storage_key"]

ACCEPTED_FORMS = (
    "s3://bucket/prefix",
    "gs://bucket/prefix",
    "https://<account>.blob.core.windows.net/<container>/<prefix>",
    "hf://owner/model[:revision][/sub/dir]",
    "oci://registry/repository[:tag|@sha256:digest]",
    "hdfs://[namenode]/path, webhdfs://[namenode]/path",
    "http(s)://[user:password@]host/path/file[#sha256=<hex>]",
    "pvc://claim/path",
    "file:///abs/path or /abs/path",
)


def storage_key(uri: str) -> str:
    """KServe's folder name for a model: sha256 of the raw URI, first 16 hex chars.

    Deliberately not normalised: ``s3://b/m`` and ``s3://b/m/`` are different keys in KServe,
    and pods rewritten by KServe's webhook look for exactly this folder.
    """
    # surrogatepass: an argument that is not UTF-8 (never a valid URI) still gets a key, no traceback.
    return hashlib.sha256(uri.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _invalid(uri: str, why: str) -> InvalidURIError:
    """The one invalid-URI error: the URI redacted, and no secret part of it in ``why`` either.
    It ends with the form its scheme takes (nothing more when ``why`` says it already), and with
    every accepted form only when the scheme is not one we know."""
    from modelcache.sources.backends import external

    forms = (*ACCEPTED_FORMS, *(b.form for b in external()))
    scheme = uri.partition("://")[0].lower() if isinstance(uri, str) and "://" in uri else ""
    scheme = {"https": "http", "webhdfs": "hdfs"}.get(scheme, scheme)
    mine = [f for f in forms if scheme and f.startswith((scheme + "://", scheme + "(s)://"))]
    if "expected " in why:
        tail = ""
    elif mine:
        tail = f". Accepted form: {mine[0]}"
    else:
        tail = f". Accepted forms: {'; '.join(forms)}"
    why = printable(scrub_parts(why, uri))
    return InvalidURIError(f"invalid storage URI '{redact_uri(uri)}': {why}{tail}")


def _no_dot_segments(uri: str, path: str, what: str) -> None:
    """A key or path with '..' segments is refused before any request: it names something else
    than it seems on the server, and a local path built from it could leave its folder."""
    if ".." in path.split("/"):
        raise _invalid(uri, f"{what} must not contain '..' segments")


def _authority(uri: str) -> SplitResult:
    """urlsplit, with a malformed host or port as our one-line error instead of a ValueError."""
    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 -- parsing the port is what raises on a bad one
    except ValueError as exc:
        raise _invalid(uri, f"malformed host or port ({exc})") from None
    return parts


@dataclass(frozen=True)
class Location:
    """A parsed storage URI. ``kind`` names its line in ``modelcache.sources.backends``."""

    uri: str = field(repr=False)  # raw: may hold userinfo, a SAS query, a token (``display`` is safe)
    #: Where credentials written into a URI of this form belong instead (the invalid-URI error
    #: names it); a backend with its own module sets it there.
    credentials_hint: ClassVar[str] = ""

    @property
    def kind(self) -> str:
        """The backend's name in ``modelcache.sources.backends`` (the one place it is spelled)."""
        from modelcache.sources.backends import kind_of

        return kind_of(type(self))

    @property
    def storage_key(self) -> str:
        return storage_key(self.uri)

    @property
    def display(self) -> str:
        """The URI as safe to print: no query string (it may hold a SAS token or signature)."""
        return redact_uri(self.uri)

    def at_revision(self, revision: str) -> Location | None:
        """The same URI (and storage key) pinned to an immutable ``revision`` of its source, for
        listing it there; None: this kind of source has no such revisions."""
        return None

    def digest_pin(self) -> tuple[str, str] | None:
        """(algo, hex) the URI itself pins the model's one file to, if it does (``#sha256=``)."""
        return None

    @property
    def identity(self) -> tuple[str, ...]:
        """What the URI points at, whatever its spelling (``/m``, ``/m/`` and ``file:///m`` are one
        folder). KServe keys models by the raw text, so those are stored apart: this only lets
        the CLI say so."""
        return (self.kind, self.display.rstrip("/"))


_LOCATION_PARSERS: list[tuple[Callable[[str], bool], Callable[[str], Location]]] = []


def register_location(
    matches: Callable[[str], bool],
) -> Callable[[type[Location]], type[Location]]:
    """Register a Location subclass; it must define ``parse(uri) -> Location``."""

    def deco(cls: type[Location]) -> type[Location]:
        _LOCATION_PARSERS.append((matches, cls.parse))  # type: ignore[attr-defined]
        return cls

    return deco


#: GCS's own rule (google-cloud-storage refuses other names before any request).
_GCS_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]")
#: What boto3 sends, which is what KServe accepts for ``s3://`` (it hands the URI's host part to
#: boto3 unchanged): botocore's VALID_BUCKET. Upper case and ``_`` are legacy us-east-1 names and
#: Ceph's relaxed names; botocore addresses them path-style.
_S3_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")


def _split_bucket(uri: str, scheme: str, rule: re.Pattern[str]) -> tuple[str, str]:
    rest = uri[len(scheme) + 3 :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise _invalid(uri, "missing bucket name")
    if not rule.fullmatch(bucket) or ".." in bucket:
        # ('..' anywhere: a path-style URL would carry it as a dot segment, naming another bucket.)
        raise _invalid(uri, f"'{bucket}' is not a valid bucket name")
    if scheme == "gs" and re.fullmatch(r"[0-9]+(\.[0-9]+){3}", bucket):
        raise _invalid(uri, f"'{bucket}' is not a valid bucket name (an IP address)")
    _no_dot_segments(uri, prefix, "the object key prefix")
    return bucket, prefix


@dataclass(frozen=True)
class _BucketLocation(Location):
    """``<scheme>://bucket[/prefix]``: a bucket and a key prefix, as S3 and GCS write them."""

    scheme: ClassVar[str]
    bucket_rule: ClassVar[re.Pattern[str]]
    bucket: str = ""
    prefix: str = ""

    @classmethod
    def parse(cls, uri: str) -> Self:
        bucket, prefix = _split_bucket(uri, cls.scheme, cls.bucket_rule)
        return cls(uri=uri, bucket=bucket, prefix=prefix)


@register_location(lambda u: u.startswith("s3://"))
@dataclass(frozen=True)
class S3Location(_BucketLocation):
    scheme = "s3"
    bucket_rule = _S3_BUCKET


@register_location(lambda u: u.startswith("gs://"))
@dataclass(frozen=True)
class GCSLocation(_BucketLocation):
    scheme = "gs"
    bucket_rule = _GCS_BUCKET


# KServe (kserve_storage.py, _AZURE_BLOB_RE) tries `https://(.+?).blob.core.windows.net/(.+)`
# unanchored, so any host ending so is Azure Blob: the account's own, and Private Link's
# `<account>.privatelink.blob.core.windows.net`; the account is the host's first label. Anchored
# here to the host (KServe's would also take `https://evil.example/x.blob.core.windows.net/...`
# and send it Azure credentials).
_AZURE_HOST = r"^https://([^./?#@:]+)(?:\.[^./?#@:]+)*?"
_AZURE_BLOB = re.compile(_AZURE_HOST + r"\.blob\.core\.windows\.net(?::[0-9]+)?/|"
                         + _AZURE_HOST + r"\.z[0-9]{1,2}\.blob\.storage\.azure\.net(?::[0-9]+)?/")
_AZURE_FILE = re.compile(_AZURE_HOST + r"\.file\.core\.windows\.net(?::[0-9]+)?/|"
                         + _AZURE_HOST + r"\.z[0-9]{1,2}\.file\.storage\.azure\.net(?::[0-9]+)?/")


@register_location(lambda u: bool(_AZURE_FILE.match(u)))
@dataclass(frozen=True)
class AzureFileLocation(Location):

    @classmethod
    def parse(cls, uri: str) -> AzureFileLocation:
        raise UnsupportedError(
            f"Azure File share URIs are not supported: '{redact_uri(uri)}'. "
            "Copy the model to Azure Blob storage (https://<account>.blob.core.windows.net/<container>/...)"
        )


@register_location(lambda u: bool(_AZURE_BLOB.match(u)))
@dataclass(frozen=True)
class AzureBlobLocation(Location):
    account: str = ""
    account_url: str = ""  # https://<host>[?sas]; KServe keeps the SAS query on the account URL
    container: str = ""
    prefix: str = ""
    sas: str = ""

    @classmethod
    def parse(cls, uri: str) -> AzureBlobLocation:
        parts = _authority(uri)
        account = parts.netloc.split(".", 1)[0]
        container, _, prefix = parts.path.lstrip("/").partition("/")
        if not container:
            raise _invalid(uri, "missing container name after the account host")
        _no_dot_segments(uri, unquote(prefix), "the blob prefix")
        account_url = f"https://{parts.netloc}" + (f"?{parts.query}" if parts.query else "")
        return cls(
            uri=uri,
            account=account,
            account_url=account_url,
            container=container,
            prefix=unquote(prefix),
            sas=parts.query,
        )


_HF_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@register_location(lambda u: u.startswith("hf://"))
@dataclass(frozen=True)
class HFLocation(Location):
    repo_id: str = ""
    revision: str | None = None
    subfolder: str = ""

    @classmethod
    def parse(cls, uri: str) -> HFLocation:
        rest = uri[len("hf://") :].strip("/")
        segments = rest.split("/")
        if len(segments) < 2 or not all(segments):
            raise _invalid(uri, "expected hf://owner/model[:revision][/sub/dir]")
        owner, model = segments[0], segments[1]
        revision = None
        if ":" in model:
            model, revision = model.split(":", 1)
            if not revision:
                raise _invalid(uri, "empty revision after ':'")
        repo_id = f"{owner}/{model}"
        if not _HF_REPO.fullmatch(repo_id):
            raise _invalid(uri, f"'{repo_id}' is not a valid Hugging Face repository id")
        sub = "/".join(segments[2:])
        if ".." in segments[2:]:
            raise _invalid(uri, "sub-folder must not contain '..'")
        return cls(uri=uri, repo_id=repo_id, revision=revision, subfolder=sub)

    def at_revision(self, revision: str) -> HFLocation | None:
        return dataclasses.replace(self, revision=revision) if re.fullmatch(r"[0-9a-f]{40}", revision) else None


_OCI_SCHEMES = ("oci://", "oci+fetch://", "oci+modelcar://", "oci+native://")


@register_location(lambda u: u.startswith(_OCI_SCHEMES))
@dataclass(frozen=True)
class OCILocation(Location):
    registry: str = ""
    repository: str = ""
    tag: str | None = None
    digest: str | None = None
    mode: str = ""  # "", "fetch", "modelcar" or "native" (from oci+<mode>://)

    @property
    def reference(self) -> str:
        return self.digest or self.tag or "latest"

    @classmethod
    def parse(cls, uri: str) -> OCILocation:
        scheme, rest = uri.split("://", 1)
        mode = scheme.partition("+")[2]
        registry, _, name = rest.partition("/")
        if not registry or not name:
            raise _invalid(uri, "expected oci://registry/repository[:tag|@sha256:digest]")
        host = _authority(f"//{registry}")
        if not host.hostname or not re.fullmatch(r"[A-Za-z0-9.:\[\]-]+", registry):
            raise _invalid(uri, f"'{registry}' is not a valid registry host[:port]")
        digest = tag = None
        if "@" in name:
            name, digest = name.split("@", 1)
            if not re.fullmatch(r"sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128}", digest):
                raise _invalid(uri, f"'{digest}' is not a valid digest")
        elif ":" in name.rsplit("/", 1)[-1]:
            name, tag = name.rsplit(":", 1)
            if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", tag):
                raise _invalid(uri, f"'{tag}' is not a valid tag")
        if not re.fullmatch(r"[a-z0-9]+(?:[._-][a-z0-9]+|__)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*", name):
            raise _invalid(uri, f"'{name}' is not a valid repository name")
        return cls(uri=uri, registry=registry, repository=name, tag=tag, digest=digest, mode=mode)


@register_location(lambda u: u.startswith(("hdfs://", "webhdfs://")))
@dataclass(frozen=True)
class HDFSLocation(Location):
    scheme: str = "hdfs"
    namenode: str = ""  # host[:port] from the URI; empty means "from HDFS_NAMENODE"
    path: str = ""

    @classmethod
    def parse(cls, uri: str) -> HDFSLocation:
        parts = _authority(uri)
        # KServe reads everything after the scheme as the path (hdfs://models is /models).
        if not (parts.netloc + parts.path).strip("/"):
            raise _invalid(uri, "missing path")
        _no_dot_segments(uri, unquote(parts.path), "the path")
        return cls(uri=uri, scheme=parts.scheme, namenode=parts.netloc, path=unquote(parts.path))


@register_location(lambda u: u.startswith("pvc://"))
@dataclass(frozen=True)
class PVCLocation(Location):
    claim: str = ""
    path: str = ""

    @classmethod
    def parse(cls, uri: str) -> PVCLocation:
        claim, _, path = uri[len("pvc://") :].partition("/")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", claim or "-"):
            raise _invalid(uri, "expected pvc://claim-name/path")
        if ".." in path.split("/"):
            raise _invalid(uri, "path must not contain '..'")
        return cls(uri=uri, claim=claim, path=path.strip("/"))


@register_location(lambda u: u.startswith("file://") or u.startswith("/"))
@dataclass(frozen=True)
class LocalLocation(Location):
    path: str = ""

    @classmethod
    def parse(cls, uri: str) -> LocalLocation:
        path = unquote(uri[len("file://") :]) if uri.startswith("file://") else uri
        if not path.startswith("/"):
            raise _invalid(uri, "file:// URIs need an absolute path (file:///models/m)")
        if "\x00" in path:
            raise _invalid(uri, "the path has a NUL byte")
        return cls(uri=uri, path=os.path.normpath(path))

    @property
    def identity(self) -> tuple[str, ...]:
        return (self.kind, self.path)


_DIGEST_HEX_LEN = {"sha256": 64, "sha512": 128, "sha1": 40, "md5": 32}


@register_location(lambda u: u.startswith(("http://", "https://")))
@dataclass(frozen=True)
class HTTPLocation(Location):
    url: str = field(default="", repr=False)  # what is requested: no fragment, no userinfo
    host: str = ""
    filename: str = ""
    pinned: tuple[str, str] | None = None  # (algo, hex) from a #sha256=<hex> fragment
    #: (user, password) of ``http(s)://user:password@host/...``: sent as HTTP basic auth, as
    #: KServe's initializer (requests) does; never printed (``display`` redacts it).
    basic_auth: tuple[str, str] | None = field(default=None, repr=False)

    def digest_pin(self) -> tuple[str, str] | None:
        return self.pinned

    @classmethod
    def parse(cls, uri: str) -> HTTPLocation:
        scheme, _, rest = uri.partition("://")
        userinfo, after = split_userinfo(rest)
        basic_auth = None
        if userinfo is not None:
            user, _, password = userinfo.partition(":")
            basic_auth = (unquote(user), unquote(password))
            uri_no_auth = f"{scheme}://{after}"
        else:
            uri_no_auth = uri
        parts = _authority(uri_no_auth)
        if not parts.hostname:
            raise _invalid(uri, "missing host")
        filename = unquote(parts.path.rsplit("/", 1)[-1])
        if not filename or filename in (".", ".."):
            raise _invalid(uri, "no filename in the URL path (HTTP URIs name one file)")
        pinned = None
        if parts.fragment:
            m = DIGEST_PIN.match(parts.fragment)
            if not m or len(m.group(2)) != _DIGEST_HEX_LEN[m.group(1)]:
                raise _invalid(uri, "the fragment must pin a digest as #sha256=<64 hex chars>")
            pinned = (m.group(1), m.group(2).lower())
        url = uri_no_auth.split("#", 1)[0]
        return cls(uri=uri, url=url, host=parts.hostname, filename=filename, pinned=pinned, basic_auth=basic_auth)


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _check_generic(uri: str) -> None:
    """What no scheme accepts, checked before any scheme's own rules (and before credentials
    are looked up or a connection is made): control characters, text that is not UTF-8, and
    credentials written into the URI (other tools would print them; ours would not use them)."""
    bad = _CONTROL.search(uri)
    if bad:
        raise _invalid(uri, f"control character {bad.group()!r} at position {bad.start()}")
    try:
        uri.encode("utf-8")
    except UnicodeEncodeError:
        raise _invalid(uri, "not valid UTF-8 text") from None
    scheme, sep, rest = uri.partition("://")
    userinfo, after = split_userinfo(rest) if sep else (None, rest)
    if userinfo is not None and not _basic_auth_allowed(scheme, after):
        raise _invalid(uri, f"credentials must not be written into the URI; {_credentials_hint(scheme)}")


def _basic_auth_allowed(scheme: str, after_userinfo: str) -> bool:
    """``http(s)://user:password@host/file``: KServe's initializer (requests) sends the userinfo as
    HTTP basic auth, so we do too. Not for Azure hosts (a SAS query or AZURE_* variables)."""
    host = "https://" + after_userinfo
    return scheme in ("http", "https") and not (_AZURE_BLOB.match(host) or _AZURE_FILE.match(host))


def _credentials_hint(scheme: str) -> str:
    return {
        "s3": "use AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the service account's secret",
        "gs": "use GOOGLE_APPLICATION_CREDENTIALS or the service account's secret",
        "hf": "use HF_TOKEN",
        "https": "Azure Blob URIs take a SAS query or the AZURE_* variables",
        "hdfs": "use the HDFS secret (HDFS_SECRET_DIR)",
        "webhdfs": "use the HDFS secret (HDFS_SECRET_DIR)",
    }.get(scheme.lower()) or _external_hint(scheme) or "use the credentials of the storage secret or environment"


def _external_hint(scheme: str) -> str:
    """The hint of a backend whose Location lives in its own module (its ``credentials_hint``)."""
    from modelcache.sources.backends import external, load

    for backend in external():
        if f"{scheme.lower()}://" in backend.prefixes:
            return str(load(backend.location).credentials_hint)
    return ""


def _parse(parse: Callable[[str], Location], uri: str) -> Location:
    try:
        return parse(uri)
    except InvalidURIError:
        if not secret_parts(uri):
            raise
    # The reason was worded from the raw text, which has a query or fragment (a
    # signature, a token) that may be quoted in part: word it again from the redacted URI.
    try:
        parse(redact_uri(uri))
    except InvalidURIError as exc:
        raise InvalidURIError(str(exc)) from None
    raise _invalid(uri, "its query or fragment part is not valid here")


def parse_uri(uri: str) -> Location:
    """Parse ``uri`` into its typed location, or raise ``InvalidURIError`` (one line, redacted).

    Any string either parses or raises InvalidURIError / UnsupportedError: never another error.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise _invalid(str(uri), "empty URI")
    if uri != uri.strip():
        raise _invalid(uri, "leading or trailing whitespace")
    _check_generic(uri)
    for matches, parse in _LOCATION_PARSERS:
        if matches(uri):
            return _parse(parse, uri)
    from modelcache.sources.backends import external, load

    for backend in external():
        if uri.startswith(backend.prefixes):
            return _parse(load(backend.location).parse, uri)
    scheme = uri.split("://", 1)[0] if "://" in uri else None
    if scheme:
        raise _invalid(uri, f"unknown scheme '{scheme}://'")
    raise _invalid(uri, "not an absolute path and no scheme")
