"""HTTP 429 handling shared by sources whose listing goes through a client we do not drive
request by request (huggingface_hub, the ``hdfs`` package).

File reads need none of this: a RateLimitedError from ``open_range`` carries ``retry_after``
and the transfer engine waits that long. A listing is not retried by the engine, so the
source waits out the server's Retry-After itself, a bounded number of times.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from email.utils import parsedate_to_datetime
from typing import TypeVar

from modelcache.errors import RateLimitedError

ATTEMPTS = 5
#: Total seconds a listing may spend waiting; a longer Retry-After fails at once (the error
#: still carries it, for a caller that reschedules).
WAIT_BUDGET = 300.0
_T = TypeVar("_T")
log = logging.getLogger(__name__)


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from a Retry-After header: delay-seconds or an HTTP date (RFC 9110 10.2.3)."""
    value = (headers.get("Retry-After") or "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None  # unreadable: let the caller's backoff decide


def wait_out(call: Callable[[], _T], where: str, sleep: Callable[[float], None] = time.sleep) -> _T:
    """Run ``call``; on RateLimitedError wait Retry-After (else 1, 2, 4, 8 s) and run it again."""
    waited = 0.0
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except RateLimitedError as exc:
            wait = exc.retry_after if exc.retry_after is not None else float(min(8, 2 ** (attempt - 1)))
            if attempt == ATTEMPTS or waited + wait > WAIT_BUDGET:
                raise
            log.warning("%s: rate-limited; retrying in %.0f s", where, wait)
            sleep(wait)
            waited += wait
    raise AssertionError("unreachable")
