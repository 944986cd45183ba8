"""Error types shared by every layer.

Every error a user can see is a ``ModelcacheError`` whose ``str()`` is one line naming the
object (URI, file, path) and, where we know it, the fix. Callers (CLI, initializer, agent)
print ``str(err)`` and never a traceback, so messages must never contain secrets: sources
redact signed URLs and credentials before raising.
"""

from __future__ import annotations


class ModelcacheError(Exception):
    """Base class; ``reason`` is a short machine-readable tag used in metrics and status."""

    reason = "Error"
    #: Whether retrying the same operation later might succeed.
    retryable = False


class CancelledError(ModelcacheError):
    """The caller cancelled the pull (staged data is kept for a resume)."""

    reason = "Cancelled"


class InvalidURIError(ModelcacheError, ValueError):
    reason = "InvalidURI"


class UnsupportedError(ModelcacheError):
    reason = "Unsupported"


class SourceError(ModelcacheError):
    """The storage backend refused or failed a request."""

    reason = "SourceError"


class SourceChangedError(SourceError):
    """The object changed while it was read: its bytes would mix two versions (pull again)."""

    reason = "SourceChanged"


class NotFoundError(SourceError):
    reason = "NotFound"


class AuthError(SourceError):
    """Missing or rejected credentials (HTTP 401 and its equivalents)."""

    reason = "Unauthorized"


class AccessDeniedError(SourceError):
    """Credentials accepted but not allowed (HTTP 403 and its equivalents)."""

    reason = "AccessDenied"


class TransientError(SourceError):
    """Connection reset, 5xx, short read, stall: retrying may help."""

    reason = "Transient"
    retryable = True


class RateLimitedError(TransientError):
    reason = "RateLimited"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class IntegrityError(ModelcacheError):
    """Bytes on disk do not match the checksum the source (or the user) promised."""

    reason = "IntegrityError"
    retryable = True


class StoreError(ModelcacheError):
    """The node store cannot be written (read-only, out of space, corrupt layout)."""

    reason = "StoreError"


class ModelInUseError(StoreError):
    """Another process works on the model (a pull, a removal), or a pod on this node mounts it."""

    reason = "InUse"


class InsufficientSpaceError(StoreError):
    reason = "InsufficientSpace"
