"""Keep secrets out of everything the init container prints.

Messages of ``ModelcacheError`` are written to be safe, but an unexpected exception from an
SDK may quote a signed URL or echo a header. Every line we print goes through ``Scrubber``:
it redacts every URL in it (``modelcache.runtime.redact``: userinfo, query strings, fragments), and
any value of a secret-looking environment variable (keys, tokens, passwords,
``<host>-headers`` values, secrets in ``STORAGE_CONFIG``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping

from modelcache.runtime.redact import REDACTED, scrub_urls

_SECRET_NAME = re.compile(r"(?i)(secret|token|passw|key|credential|sas|signature|auth|cookie|session|header)")
_SECRET_NAME_EXCLUDE = re.compile(r"(?i)(_FILE$|_PATH$|_DIR$|KEY_ID$|KEYTAB$|_NAME$)")
#: Values shorter than this are not treated as secrets (they would blank out ordinary words).
_MIN_SECRET = 6


def _json_strings(raw: str) -> Iterable[tuple[str, str]]:
    try:
        parsed = json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        return []
    out: list[tuple[str, str]] = []

    def walk(node: object, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, str(k))
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        elif isinstance(node, str):
            out.append((key, node))

    walk(parsed, "")
    return out


def secret_values(env: Mapping[str, str]) -> list[str]:
    """Values in ``env`` that must never be printed."""
    found: set[str] = set()
    for name, value in env.items():
        if not value:
            continue
        if name.endswith("-headers"):
            # Every header value may be a credential (Authorization, X-Api-Key, cookies).
            found.update(v for _, v in _json_strings(value))
            found.add(value)
        elif name in ("STORAGE_CONFIG", "STORAGE_OVERRIDE_CONFIG"):
            for k, v in _json_strings(value):
                if _SECRET_NAME.search(k) and not _is_benign(k):
                    found.add(v)
                    # e.g. an HDFS spec's HEADERS: a JSON object inside a string.
                    found.update(inner for _, inner in _json_strings(v))
        elif _SECRET_NAME.search(name) and not _SECRET_NAME_EXCLUDE.search(name) and not _is_path(value):
            found.add(value)
    return sorted((v for v in found if len(v) >= _MIN_SECRET), key=len, reverse=True)


def _is_path(value: str) -> bool:
    # GOOGLE_APPLICATION_CREDENTIALS and friends name files: useful in errors, not secret.
    return value.startswith("/") and not any(c.isspace() for c in value)


def _is_benign(key: str) -> bool:
    return bool(_SECRET_NAME_EXCLUDE.search(key.upper())) or key.lower() in ("access_key_id",)


class Scrubber:
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Scrubber:
        return cls(secret_values(env))

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return scrub_urls(" ".join(text.split("\n")).strip())


class ScrubbingFormatter(logging.Formatter):
    """Library log records (urllib3 retries, SDK warnings) go through the scrubber too."""

    def __init__(self, scrub: Scrubber) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self._scrub = scrub

    def format(self, record: logging.LogRecord) -> str:
        return self._scrub(super().format(record))
