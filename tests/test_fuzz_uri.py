"""Property-based tests of the URI parser and of redaction (``make fuzz`` runs them longer).

- any string parses or raises our invalid-URI (or unsupported) error, never anything else, and
  the error is one printable line;
- valid URIs built from parts parse back into those parts, keep the raw string (so KServe's
  storage key, sha256 of the raw URI, is unchanged) and parse the same again;
- a userinfo secret, a signed query or a token fragment never survives redaction, in the
  display form, an error message or free text.
"""

from __future__ import annotations

import hashlib
import string
import unicodedata

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from modelcache.errors import InvalidURIError, ModelcacheError, UnsupportedError
from modelcache.runtime.redact import redact_uri, scrub_urls
from modelcache.sources.uri import (
    GCSLocation,
    HDFSLocation,
    HFLocation,
    HTTPLocation,
    OCILocation,
    S3Location,
    parse_uri,
    storage_key,
)
from tests.fuzzing import examples

pytestmark = pytest.mark.fuzz

SCHEMES = ["s3://", "gs://", "hf://", "oci://", "oci+modelcar://", "hdfs://", "webhdfs://", "pvc://", "file://",
           "http://", "https://", "https://acct.blob.core.windows.net/", "https://a.file.core.windows.net/", "/",
           "ftp://", ""]
URL_CHARS = string.ascii_letters + string.digits + "-._~:/?#[]@!$&'()*+,;=%\\ \t\n\x00\x7f"

uri_like = st.builds(lambda s, rest: s + rest, st.sampled_from(SCHEMES), st.text(alphabet=URL_CHARS, max_size=60))
anything = st.one_of(uri_like, st.text(max_size=60),
                     st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape")))


def one_line(text: str) -> bool:
    """No line break of any kind and no control character (C0, C1, DEL) in ``text``."""
    return len(text.splitlines()) <= 1 and not any(unicodedata.category(c) == "Cc" for c in text)


@hsettings(max_examples=examples(600))
@given(anything)
def test_any_string_parses_or_is_one_invalid_uri_line(uri: str) -> None:
    try:
        loc = parse_uri(uri)
    except (InvalidURIError, UnsupportedError) as exc:
        msg = str(exc)
        assert one_line(msg), repr(msg)
        return
    assert loc.uri == uri
    assert storage_key(uri) == hashlib.sha256(uri.encode()).hexdigest()[:16]
    assert one_line(loc.display), repr(loc.display)


@hsettings(max_examples=examples(600))
@given(anything)
def test_redaction_never_raises_and_is_one_line(text: str) -> None:
    for out in (redact_uri(text), scrub_urls(text)):
        assert isinstance(out, str) and one_line(out), repr(out)


# -- round trips -------------------------------------------------------------------------------

label = st.text(alphabet=string.ascii_lowercase + string.digits, min_size=1, max_size=10)
bucket = st.builds(lambda a, m, z: a + m + z, st.sampled_from("abcxyz019"),
                   st.text(alphabet=string.ascii_lowercase + string.digits + "-", min_size=1, max_size=20),
                   st.sampled_from("abcxyz019"))
segment = st.text(alphabet=string.ascii_letters + string.digits + "-_.@+=", min_size=1, max_size=12).filter(
    lambda s: s not in (".", ".."))
key = st.lists(segment, max_size=4).map("/".join)


@hsettings(max_examples=examples(300))
@given(st.sampled_from(["s3", "gs"]), bucket, key)
def test_bucket_uris_round_trip(scheme: str, name: str, prefix: str) -> None:
    uri = f"{scheme}://{name}/{prefix}"
    loc = parse_uri(uri)
    assert isinstance(loc, S3Location if scheme == "s3" else GCSLocation)
    assert (loc.bucket, loc.prefix, loc.uri) == (name, prefix, uri)
    assert loc.storage_key == storage_key(uri) and parse_uri(loc.uri) == loc


@hsettings(max_examples=examples(300))
@given(label, label, st.none() | st.text(alphabet=string.ascii_letters + string.digits + "._-", min_size=1,
                                         max_size=12), key)
def test_hf_uris_round_trip(owner: str, model: str, revision: str | None, sub: str) -> None:
    uri = f"hf://{owner}/{model}" + (f":{revision}" if revision else "") + (f"/{sub}" if sub else "")
    loc = parse_uri(uri)
    assert isinstance(loc, HFLocation)
    assert (loc.repo_id, loc.revision, loc.subfolder) == (f"{owner}/{model}", revision, sub)
    assert loc.uri == uri and parse_uri(uri) == loc


@hsettings(max_examples=examples(300))
@given(label, st.none() | st.integers(1, 65535), st.lists(label, min_size=1, max_size=3),
       st.none() | label, st.none() | st.binary(min_size=32, max_size=32))
def test_oci_uris_round_trip(host: str, port: int | None, repo: list[str], tag: str | None,
                             digest: bytes | None) -> None:
    registry = host + (f":{port}" if port else "")
    ref = f"@sha256:{digest.hex()}" if digest else (f":{tag}" if tag else "")
    uri = f"oci://{registry}/{'/'.join(repo)}{ref}"
    loc = parse_uri(uri)
    assert isinstance(loc, OCILocation)
    assert (loc.registry, loc.repository) == (registry, "/".join(repo))
    assert loc.digest == (f"sha256:{digest.hex()}" if digest else None)
    assert loc.uri == uri and parse_uri(uri) == loc


@hsettings(max_examples=examples(300))
@given(st.sampled_from(["http", "https", "hdfs", "webhdfs"]), label, st.none() | st.integers(1, 65535), key, label)
def test_host_uris_round_trip(scheme: str, host: str, port: int | None, path: str, name: str) -> None:
    netloc = host + (f":{port}" if port else "")
    uri = f"{scheme}://{netloc}/{path + '/' if path else ''}{name}.bin"
    loc = parse_uri(uri)
    assert loc.uri == uri and loc.storage_key == storage_key(uri) and parse_uri(uri) == loc
    if isinstance(loc, HTTPLocation):
        assert (loc.host, loc.filename, loc.url) == (host, f"{name}.bin", uri)
    else:
        assert isinstance(loc, HDFSLocation) and loc.namenode == netloc


# -- redaction ---------------------------------------------------------------------------------

MARK = "Zq9X"  # cannot come out of the lowercase alphabets the other parts are drawn from
secret_text = st.text(alphabet=string.ascii_letters + string.digits + "/+=-_.~!$&'()*,;:%", max_size=24).map(
    lambda s: MARK + s)
host = st.text(alphabet=string.ascii_lowercase + string.digits + ".-", min_size=1, max_size=15)
path = st.text(alphabet=string.ascii_lowercase + string.digits + "/._-@", max_size=20)


@st.composite
def secret_uris(draw: st.DrawFn, places: tuple[str, ...] = ("userinfo", "query", "fragment", "all")) -> str:
    scheme = draw(st.sampled_from(["s3", "gs", "hf", "oci", "hdfs", "webhdfs", "http", "https", "pvc", "file", "x"]))
    user = draw(st.text(alphabet=string.ascii_lowercase + string.digits, max_size=8))
    where = draw(st.sampled_from(places))
    userinfo = f"{user}:{draw(secret_text)}@" if where in ("userinfo", "all") else ""
    query = f"?X-Amz-Signature={draw(secret_text)}" if where in ("query", "all") else ""
    frag = f"#token={draw(secret_text)}" if where in ("fragment", "all") else ""
    return f"{scheme}://{userinfo}{draw(host)}/{draw(path)}{query}{frag}"


@hsettings(max_examples=examples(600))
@given(secret_uris(), st.text(alphabet=" ,;'\"()[]", max_size=3))
def test_no_secret_survives_redaction_anywhere(uri: str, around: str) -> None:
    assert MARK not in redact_uri(uri)
    assert MARK not in scrub_urls(f"error{around}{uri}{around}next")
    try:
        loc = parse_uri(uri)
    except ModelcacheError as exc:
        assert MARK not in str(exc), str(exc)
        return
    assert MARK not in loc.display


@hsettings(max_examples=examples(300))
@given(secret_uris(places=("userinfo", "all")))
def test_credentials_in_the_authority_are_refused_or_basic_auth(uri: str) -> None:
    """Only http(s) takes userinfo (as basic auth, like KServe's requests); it is never shown."""
    if not uri.startswith(("http://", "https://")):
        with pytest.raises(InvalidURIError):
            parse_uri(uri)
        return
    try:
        loc = parse_uri(uri)
    except ModelcacheError as exc:
        assert MARK not in str(exc)
        return
    assert isinstance(loc, HTTPLocation) and loc.basic_auth is not None
    assert MARK in loc.basic_auth[1]
    for shown in (loc.display, repr(loc), loc.url):
        assert MARK not in shown, shown
