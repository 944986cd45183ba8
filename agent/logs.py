"""Structured log lines: ``logfmt`` by default, one JSON object per line with ``--log-format json``.

Callers pass fields with ``extra={"fields": {...}}``. Values are never credentials: the agent
logs URIs only through ``redact_uri`` and never logs settings or environment dicts.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from modelcache.clock import rfc3339


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
    # Client libraries log request details (URLs with signatures, headers) at debug: keep them quiet.
    for noisy in ("urllib3", "botocore", "boto3", "kubernetes", "azure", "google", "huggingface_hub", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def fields(**kw: Any) -> dict[str, Any]:
    """``log.info("msg", extra=fields(model=..., bytes=...))``."""
    return {"fields": kw}
