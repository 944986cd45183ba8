"""Log lines, one format per kind of program.

The long-running processes (the agent, the coordinator) write structured lines: ``logfmt`` by
default, one JSON object per line with ``--log-format json``, every time in RFC 3339. The CLI
writes what a person at a terminal reads: ``warning: <message>`` beside its ``error:`` lines (and,
with ``--log-level info`` or ``debug``, the time and the logger too).

Callers pass fields with ``extra={"fields": {...}}``. Values are never credentials: URIs are
logged only through ``redact_uri``, and no settings or environment dicts are logged.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from modelcache.runtime.clock import rfc3339


def _logfmt_value(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' ="\n\t'):
        return json.dumps(text)
    return text


class StructuredFormatter(logging.Formatter):
    def __init__(self, style: str = "logfmt") -> None:
        super().__init__()
        self.style_name = style

    def format(self, record: logging.LogRecord) -> str:
        ts = rfc3339(record.created, digits=3)
        data: dict[str, Any] = {"ts": ts, "level": record.levelname.lower(), "logger": record.name,
                                "msg": record.getMessage()}
        data.update(getattr(record, "fields", None) or {})
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            data["error"] = f"{type(exc).__name__}: {exc}"
        if self.style_name == "json":
            return json.dumps(data, default=str)
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in data.items())


def setup_logging(style: str = "logfmt", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(StructuredFormatter(style))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)


#: Client libraries log request details (URLs with signatures, headers) at debug: kept quiet.
_NOISY = ("urllib3", "botocore", "boto3", "kubernetes", "azure", "google", "huggingface_hub", "s3transfer")


class CLIFormatter(logging.Formatter):
    """``warning: message key=value``: the CLI's own lines (``error:``) and its logs look alike;
    below warning level the time and the logger are shown too (what a debugging user needs)."""

    def format(self, record: logging.LogRecord) -> str:
        extra = getattr(record, "fields", None) or {}
        text = record.getMessage() + "".join(f" {k}={_logfmt_value(v)}" for k, v in extra.items())
        level = record.levelname.lower()
        if record.levelno >= logging.WARNING:
            return f"{level}: {text}"
        return f"{rfc3339(record.created, digits=3)} {level} {record.name}: {text}"


def setup_cli_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(CLIFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def fields(**kw: Any) -> dict[str, Any]:
    """``log.info("msg", extra=fields(model=..., bytes=...))``."""
    return {"fields": kw}
