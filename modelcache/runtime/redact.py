"""Keeping credentials out of everything we print: the one place URIs are redacted.

A storage URI may carry secrets in three parts: userinfo (``scheme://user:password@host``), the
query string (S3 presigned signatures, Azure SAS tokens) and a fragment that is not a digest pin.
``redact_uri`` drops all three from one URI; ``scrub_urls`` does the same to every URL inside a
free-text message (an SDK's exception may quote a signed URL). Both never raise, whatever the
input, and always return one printable line: control characters are escaped, so a URI cannot
forge a second log line.
"""

from __future__ import annotations

import re

REDACTED = "<redacted>"

#: ``#sha256=<hex>`` and friends pin a digest: not a secret, and worth showing.
DIGEST_PIN = re.compile(r"^(sha256|sha512|sha1|md5)=([0-9a-fA-F]+)$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(.*)$", re.S)
#: C0 and C1 controls, DEL and the Unicode line/paragraph separators: anything that could end
#: a log line early or drive a terminal.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
#: URLs inside free text: a scheme, "://", then up to whitespace or a character no URL holds
#: raw. A single quote may be part of a password (RFC 3986 allows it), so it does not end one.
_URL_IN_TEXT = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s\"<>`]*")
_DIGEST_AFTER_AT = re.compile(r"^(sha256|sha512):")


def printable(text: str) -> str:
    """One line, whatever the text: control characters and lone surrogates become escapes."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                        text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def split_userinfo(after_slashes: str) -> tuple[str | None, str]:
    """(userinfo, rest) of what follows ``scheme://``; userinfo is None when there is none.

    RFC 3986 puts userinfo before an ``@`` inside the authority (up to the first ``/?#``). A
    secret with a raw ``/`` in it (AWS secret keys have them) ends the authority early, so an
    ``@`` further on still counts as ending credentials when the authority looks like
    ``name:secret`` (a ``:`` not followed by a port number) and what follows the ``@`` is not an
    OCI digest (``repo@sha256:...``). Over-redacting such a rare URL is harmless; leaking is not.
    """
    head = re.split(r"[?#]", after_slashes, maxsplit=1)[0]
    authority = head.split("/", 1)[0]
    if "@" in authority:
        at = authority.rindex("@")
        return after_slashes[:at], after_slashes[at + 1 :]
    if "@" not in head:
        return None, after_slashes
    _host, colon, port = authority.partition(":")
    at = head.index("@")
    if not colon or port.isdigit() or _DIGEST_AFTER_AT.match(head[at + 1 :]):
        return None, after_slashes  # host:port/path@..., or no ':' before the first '/'
    return head[:at], after_slashes[at + 1 :]


def _drive_path(m: re.Match[str]) -> bool:
    """``C:\\models``: a one-letter "scheme" without ``//`` is a Windows drive, not a URL."""
    return len(m.group(1)) == 1 and not m.group(2).startswith("//")


def secret_parts(uri: str) -> list[str]:
    """The substrings of ``uri`` that must never be printed (userinfo, query, non-pin fragment)."""
    m = _SCHEME.match(uri)
    if not m or _drive_path(m):
        return []
    rest = m.group(2)
    rest, hash_, fragment = rest.partition("#")
    rest, q, query = rest.partition("?")
    out = []
    if rest.startswith("//"):
        userinfo, _ = split_userinfo(rest[2:])
        if userinfo:
            out.append(userinfo)
    if q and query:
        out.append(query)
    if hash_ and fragment and not DIGEST_PIN.match(fragment):
        out.append(fragment)
    return sorted(out, key=len, reverse=True)


def redact_uri(uri: str) -> str:
    """``uri`` safe to print: userinfo, query and a non-pin fragment become ``<redacted>``."""
    uri = uri if isinstance(uri, str) else str(uri)
    m = _SCHEME.match(uri)
    if not m or _drive_path(m):  # a plain path
        return printable(uri)
    scheme, rest = m.groups()
    rest, hash_, fragment = rest.partition("#")
    rest, q, _query = rest.partition("?")
    if rest.startswith("//"):
        userinfo, after = split_userinfo(rest[2:])
        # The marker stays: a user comparing the line with what they typed sees what was cut.
        rest = "//" + ("" if userinfo is None else f"{REDACTED}@") + after
    out = f"{scheme}:{rest}"
    if q:
        out += f"?{REDACTED}"
    if hash_:
        out += "#" + (fragment if DIGEST_PIN.match(fragment) else REDACTED)
    return printable(out)


#: Punctuation a sentence puts right after a URL (``uri: cause``, ``'uri'``), not part of it.
_TRAILING = re.compile(r"[:;,.')]+$")


def _scrub_one(url: str) -> str:
    """One URL found in text, redacted. Punctuation that ends it is the sentence's, not the URL's,
    where nothing secret can end there (no query; no fragment but a digest pin): a pinned URI
    followed by ``:`` is shown with its pin and its colon, not as ``#<redacted>``."""
    tail = _TRAILING.search(url)
    if tail:
        head = url[: tail.start()]
        _rest, hash_, fragment = head.partition("#")
        if "?" not in head and (not hash_ or DIGEST_PIN.match(fragment)):
            return redact_uri(head) + tail.group(0)
    return redact_uri(url)


def scrub_urls(text: str) -> str:
    """Every URL inside ``text`` redacted; the result is one printable line."""
    return printable(_URL_IN_TEXT.sub(lambda m: _scrub_one(m.group(0)), text))


def scrub_parts(text: str, uri: str) -> str:
    """``text`` with every secret part of ``uri`` (wherever it was quoted) replaced."""
    for part in secret_parts(uri):
        text = text.replace(part, REDACTED)
    return text


#: Query parameters that carry a credential: S3/GCS presigned URLs (SigV4, SigV2, Google V4), Azure
#: SAS tokens (``sig``), and the usual token names of HTTP APIs. Compared case-insensitively.
CREDENTIAL_PARAMETERS = frozenset({
    "x-amz-signature", "x-amz-credential", "x-amz-security-token", "signature", "awsaccesskeyid",
    "x-goog-signature", "x-goog-credential", "sig", "token", "access_token", "api_key", "apikey", "password",
})


def credentials_in(uri: str) -> list[str]:
    """What of ``uri`` is a credential, named for a message (never the value): ``userinfo`` and
    each credential query parameter. [] for a URI that carries none."""
    m = _SCHEME.match(uri)
    if not m or _drive_path(m):
        return []
    rest = m.group(2).partition("#")[0]
    rest, _q, query = rest.partition("?")
    found = []
    if rest.startswith("//") and split_userinfo(rest[2:])[0] is not None:
        found.append("userinfo")
    for pair in query.split("&"):
        name = pair.partition("=")[0]
        if name.lower() in CREDENTIAL_PARAMETERS and f"query parameter {name}" not in found:
            found.append(f"query parameter {name}")
    return found
