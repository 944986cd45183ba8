"""URI parsing and KServe's storage key."""
# ruff: noqa: E501

from __future__ import annotations

import hashlib

import pytest

from modelcache.errors import InvalidURIError, UnsupportedError
from modelcache.sources.uri import (
    AzureBlobLocation,
    GCSLocation,
    HDFSLocation,
    HFLocation,
    HTTPLocation,
    LocalLocation,
    OCILocation,
    PVCLocation,
    S3Location,
    parse_uri,
    redact_uri,
    storage_key,
)


def test_storage_key_is_kserves_rule_byte_for_byte():
    uri = "s3://bucket/models/llama/"
    assert storage_key(uri) == hashlib.sha256(uri.encode()).hexdigest()[:16]
    assert storage_key("s3://bucket/models/llama") != storage_key(uri)  # trailing slash matters
    assert len(storage_key("hf://a/b")) == 16


@pytest.mark.parametrize(
    ("uri", "cls", "fields"),
    [
        ("s3://my-bucket/a/b", S3Location, {"bucket": "my-bucket", "prefix": "a/b"}),
        ("s3://my-bucket", S3Location, {"bucket": "my-bucket", "prefix": ""}),
        ("gs://bkt/m/", GCSLocation, {"bucket": "bkt", "prefix": "m/"}),
        (
            "https://acct.blob.core.windows.net/cont/pre/fix?sv=1&sig=abc",
            AzureBlobLocation,
            {"account": "acct", "container": "cont", "prefix": "pre/fix", "sas": "sv=1&sig=abc",
             "account_url": "https://acct.blob.core.windows.net?sv=1&sig=abc"},
        ),
        ("https://acct.z12.blob.storage.azure.net/c/p", AzureBlobLocation, {"account": "acct", "container": "c"}),
        # What KServe v0.20.0 accepts as well (audit C2, C10): legacy us-east-1 and Ceph bucket names
        # (botocore's rule, addressed path-style), and Azure Private Link hosts (the account URL kept).
        ("s3://My_Bucket/model", S3Location, {"bucket": "My_Bucket", "prefix": "model"}),
        ("s3://LEGACY.Bucket_01/m/v1", S3Location, {"bucket": "LEGACY.Bucket_01", "prefix": "m/v1"}),
        ("s3://192.168.1.10/m", S3Location, {"bucket": "192.168.1.10"}),
        ("s3://b/m", S3Location, {"bucket": "b"}),
        (
            "https://acct.privatelink.blob.core.windows.net/cont/llama?sv=1",
            AzureBlobLocation,
            {"account": "acct", "container": "cont", "prefix": "llama",
             "account_url": "https://acct.privatelink.blob.core.windows.net?sv=1"},
        ),
        ("hf://org/model", HFLocation, {"repo_id": "org/model", "revision": None, "subfolder": ""}),
        ("hf://org/model:v1.0/sub/dir", HFLocation, {"repo_id": "org/model", "revision": "v1.0", "subfolder": "sub/dir"}),
        ("oci://reg.io:5000/ns/repo:tag1", OCILocation, {"registry": "reg.io:5000", "repository": "ns/repo", "tag": "tag1"}),
        ("oci://reg.io/repo@sha256:" + "a" * 64, OCILocation, {"digest": "sha256:" + "a" * 64, "tag": None}),
        ("oci+modelcar://reg.io/repo", OCILocation, {"mode": "modelcar", "reference": "latest"}),
        ("hdfs://nn:9000/models/m", HDFSLocation, {"scheme": "hdfs", "namenode": "nn:9000", "path": "/models/m"}),
        ("webhdfs:///models/m", HDFSLocation, {"scheme": "webhdfs", "namenode": "", "path": "/models/m"}),
        ("pvc://claim-1/models/m", PVCLocation, {"claim": "claim-1", "path": "models/m"}),
        ("file:///srv/m", LocalLocation, {"path": "/srv/m"}),
        ("/srv/m/", LocalLocation, {"path": "/srv/m"}),
        ("http://h:8080/a/m.tar.gz", HTTPLocation, {"host": "h", "filename": "m.tar.gz", "pinned": None}),
        ("https://h/m.bin#sha256=" + "AB" * 32, HTTPLocation, {"url": "https://h/m.bin", "pinned": ("sha256", "ab" * 32)}),
    ],
)
def test_parse_every_scheme(uri, cls, fields):
    loc = parse_uri(uri)
    assert type(loc) is cls
    assert loc.uri == uri
    for name, value in fields.items():
        assert getattr(loc, name) == value


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("ftp://h/x", "unknown scheme 'ftp://'"),
        ("models/relative", "not an absolute path"),
        ("", "empty URI"),
        ("s3://", "missing bucket"),
        ("s3://bad!name/x", "not a valid bucket name"),
        ("gs://UPPER/x", "not a valid bucket name"),
        ("hf://onlyowner", "expected hf://owner/model"),
        ("hf://o/m:", "empty revision"),
        ("oci://reg.io", "expected oci://registry/repository"),
        ("oci://reg.io/r@sha256:zz", "not a valid digest"),
        ("http://h/", "no filename"),
        ("http://h/m.bin#sha256=abc", "pin a digest"),
        ("pvc://Bad_Claim/x", "expected pvc://claim-name/path"),
        ("pvc://c/../etc", "must not contain '..'"),
    ],
)
def test_invalid_uris_quote_the_uri_and_name_the_form_of_their_scheme(uri, why):
    with pytest.raises(InvalidURIError) as err:
        parse_uri(uri)
    msg = str(err.value)
    assert f"'{uri}'" in msg and why in msg
    if "://" not in uri or uri.startswith("ftp"):  # no scheme we know: every accepted form
        assert "s3://bucket/prefix" in msg and "hf://owner/model" in msg
        return
    # The one form of its scheme, not a 500-character list of every form (issue 27).
    assert "Accepted forms" not in msg and len(msg) < 200, msg
    scheme = uri.split("://")[0]
    assert f"{scheme}://" in msg.split("': ", 1)[1] or (scheme == "http" and "http(s)://" in msg), msg


@pytest.mark.parametrize("uri", ["ftp://h/m.bin", "models/m", "s4://b/m"])
def test_an_unknown_scheme_lists_every_accepted_form(uri):
    with pytest.raises(InvalidURIError) as err:
        parse_uri(uri)
    msg = str(err.value)
    assert "Accepted forms: " in msg and "s3://bucket/prefix" in msg and "hf://owner/model" in msg


def test_azure_hosts_are_the_hosts_not_a_path_naming_one():
    """KServe's unanchored pattern would take a path that names an Azure host as Azure (and send the
    account's credentials to that other host); only the host decides here."""
    assert type(parse_uri("https://proxy.example/acct.blob.core.windows.net/c/m.bin")) is HTTPLocation
    assert type(parse_uri("https://acct.blob.core.windows.net.example.org/c/m.bin")) is HTTPLocation
    with pytest.raises(UnsupportedError, match="Azure File share"):
        parse_uri("https://acct.privatelink.file.core.windows.net/share/m")


def test_azure_file_share_is_not_supported_and_says_so():
    with pytest.raises(UnsupportedError, match=r"Azure File share URIs are not supported: 'https://a\.file"):
        parse_uri("https://a.file.core.windows.net/share/m?sig=secret")
    try:
        parse_uri("https://a.file.core.windows.net/share/m?sig=secret")
    except UnsupportedError as exc:
        assert "secret" not in str(exc)


def test_redact_uri_drops_secrets():
    assert redact_uri("https://u:pw@h/x?sig=1") == "https://<redacted>@h/x?<redacted>"
    assert redact_uri("/plain/path") == "/plain/path"
    assert parse_uri("https://h/m.bin?X-Amz-Signature=s").display == "https://h/m.bin?<redacted>"


# -- hostile URIs: one line, nothing leaked, never a traceback ---------------------------------


@pytest.mark.parametrize(
    "uri",
    [
        "s3://AKIAEXAMPLE:Pw0rdXYZ@bucket/models",
        "s3://AKIAEXAMPLE:Pw0rd/abc+def@bucket/models",  # an AWS secret key has raw '/' in it
        "gs://svc:Pw0rdXYZ@bkt/m",
        "hf://user:Pw0rdXYZ@org/model",
        "oci://robot:Pw0rdXYZ@reg.io/repo:tag",
        "hdfs://hdfs:Pw0rdXYZ@nn:9870/models/m",
        "webhdfs://hdfs:Pw0rdXYZ@nn/models/m",
        "pvc://user:Pw0rdXYZ@claim/m",
        "https://user:Pw0rdXYZ@acct.blob.core.windows.net/c/m",
        "file://user:Pw0rdXYZ@/srv/m",
    ],
)
def test_credentials_in_any_scheme_are_refused_and_never_echoed(uri):
    with pytest.raises(InvalidURIError) as err:
        parse_uri(uri)
    msg = str(err.value)
    assert "Pw0rd" not in msg and "abc+def" not in msg, msg
    assert "credentials must not be written into the URI" in msg and "<redacted>@" in msg
    assert "Pw0rd" not in redact_uri(uri) and "abc+def" not in redact_uri(uri)


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("http://[::1/m.bin", "malformed host or port"),
        ("https://[not-ipv6]/m.bin", "malformed host or port"),
        ("https://h:99999/m.bin", "malformed host or port"),
        ("https://h:port/m.bin", "malformed host or port"),
        ("hdfs://[::1/models", "malformed host or port"),
        ("oci://[::1/repo", "malformed host or port"),
        ("oci://reg io/repo", "not a valid registry"),
        ("s3://bucket/a/../b", "must not contain '..' segments"),
        ("gs://bucket/../b", "must not contain '..' segments"),
        ("https://acct.blob.core.windows.net/c/a/%2e%2e/b", "must not contain '..' segments"),
        ("hdfs://nn/models/../etc", "must not contain '..' segments"),
        ("s3://a..b/m", "not a valid bucket name"),
        ("gs://192.168.1.10/m", "an IP address"),
        ("s3://" + "b" * 256 + "/m", "not a valid bucket name"),
        ("s3://bucket/m\nerror: forged line", "control character"),
        ("file:///srv/m%00x", "NUL byte"),
        ("s3://bucket/\udcff", "not valid UTF-8"),
    ],
)
def test_malformed_uris_are_one_invalid_uri_line(uri, why):
    with pytest.raises(InvalidURIError) as err:
        parse_uri(uri)
    msg = str(err.value)
    assert why in msg and "\n" not in msg, msg


def test_query_and_fragment_secrets_never_reach_an_error_message():
    # The bucket name quoted in the reason would carry the query part: it is cut there too.
    with pytest.raises(InvalidURIError) as err:
        parse_uri("s3://Bad?X-Amz-Signature=SECRETsig")
    assert "SECRET" not in str(err.value)
    assert redact_uri("https://h/m.bin#token=SECRETtok") == "https://h/m.bin#<redacted>"
    assert redact_uri("https://h/m.bin#sha256=" + "a" * 64).endswith("#sha256=" + "a" * 64)
    assert redact_uri("/plain/with\nnewline") == "/plain/with\\x0anewline"


def test_scrub_urls_redacts_every_url_in_free_text():
    from modelcache.runtime.redact import scrub_urls

    text = ("boto: GET https://b.s3.amazonaws.com/k?X-Amz-Signature=SECRET1 failed; "
            "retrying s3://AK:SECRET2/x@bucket/m and 'hdfs://u:SECRET3@nn/p'\nnext")
    out = scrub_urls(text)
    assert "SECRET" not in out and "\n" not in out
    assert "https://b.s3.amazonaws.com/k?<redacted>" in out and "s3://<redacted>@bucket/m" in out


def test_storage_key_never_raises_on_text_that_is_not_utf8():
    assert len(storage_key("s3://b/\udcff")) == 16


def test_http_userinfo_is_basic_auth_and_never_printed():
    """KServe's initializer (requests) sends an http(s) URL's userinfo as basic auth: so do we."""
    uri = "https://al%40ice:Pw0rd%3AXYZ@models.example.com/v1/model.bin"
    loc = parse_uri(uri)
    assert isinstance(loc, HTTPLocation)
    assert loc.basic_auth == ("al@ice", "Pw0rd:XYZ") and loc.url == "https://models.example.com/v1/model.bin"
    assert loc.host == "models.example.com" and loc.filename == "model.bin"
    for shown in (loc.display, repr(loc), loc.url):
        assert "Pw0rd" not in shown and "al%40ice" not in shown, shown
    assert loc.display == "https://<redacted>@models.example.com/v1/model.bin"
    assert loc.storage_key == storage_key(uri)  # KServe's key: the raw URI, userinfo included
    assert parse_uri("http://token@h/m.bin").basic_auth == ("token", "")
