"""``storage-initializer SRC DEST [SRC DEST ...]``: KServe's init-container entrypoint, on modelcache.

Exit status 0 when every pair succeeded, 1 otherwise (and for a usage error), as KServe's
``initializer-entrypoint``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import replace

from initializer.dispatch import Context
from initializer.redact import Scrubber, ScrubbingFormatter
from initializer.report import Reporter
from initializer.run import Pair, describe_error, pairs_from_args, run_pairs
from modelcache.engine.resources import check_buffers, chunk_size_problem
from modelcache.engine.transfer import TransferOptions
from modelcache.errors import ModelcacheError
from modelcache.runtime.progress import ProgressTracker, human_bytes
from modelcache.runtime.sizes import parse_size
from modelcache.sources.archive import ArchiveLimits
from modelcache.sources.cabundle import ca_bundle_from_env, merged_ca_bundle
from modelcache.sources.credentials import Settings
from modelcache.sources.uri import redact_uri

USAGE = "Usage: initializer-entrypoint src_uri_0 dest_path_0 ... src_uri_n dest_path_n"
def _ca_env(env: Mapping[str, str]) -> dict[str, str]:
    """Env additions that carry the custom CA bundle to every SDK that reads the standard
    variables (requests: google-auth, azure-core, oras, huggingface_hub; httpx; OpenSSL).
    The HTTP and S3 sources get it from ``Settings`` directly."""
    custom = ca_bundle_from_env(env)
    if not custom:
        return {}
    merged = merged_ca_bundle(custom)
    extra = {name: merged for name in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE") if not env.get(name)}
    # Through Settings (http.ca_bundle, s3.ca_bundle) the merged file reaches the HTTP, S3, HF
    # and OCI sources, which would otherwise trust the custom CA *instead of* the public ones.
    extra["MODELCACHE_CA_BUNDLE"] = merged
    return extra


def _settings() -> Settings:
    settings = Settings.from_env()
    extra = _ca_env(settings.env)
    if not extra:
        return settings
    # The SDKs read these from the process environment; set them before any client exists.
    os.environ.update(extra)
    return Settings.from_env({**settings.env, **extra})


def _size(name: str, raw: str) -> int:
    try:
        value = parse_size(raw)
    except ValueError as exc:
        raise ModelcacheError(f"environment variable {name}: {exc}") from None
    if value <= 0:
        raise ModelcacheError(f"environment variable {name}={raw!r} must be positive")
    return value


def _count(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ModelcacheError(f"environment variable {name}={raw!r} is not a whole number") from None
    if value <= 0:
        raise ModelcacheError(f"environment variable {name}={raw!r} must be positive")
    return value


#: The init container's memory is small (KServe's default limit is 1Gi, request 100Mi) and
#: buffers are (workers + spares) x chunk: 8 MiB chunks (the engine's default too) keep a 4 GiB
#: pull near 150 MiB peak RSS (bench/initializer_rss.py).
INIT_CHUNK_SIZE = 8 << 20


def transfer_options(env: Mapping[str, str]) -> TransferOptions:
    """Engine knobs for the init container (memory is workers x chunk size, plus spares):
    checked against their ranges, and one pull's buffers against the memory left (pairs at once
    are not counted: most pods pull one, and a failed check would stop pods that work today)."""
    base = replace(TransferOptions(), chunk_size=INIT_CHUNK_SIZE)
    workers = env.get("MODELCACHE_WORKERS")
    chunk = env.get("MODELCACHE_CHUNK_SIZE")
    options = replace(
        base,
        workers=_count("MODELCACHE_WORKERS", workers) if workers else base.workers,
        chunk_size=_size("MODELCACHE_CHUNK_SIZE", chunk) if chunk else base.chunk_size,
    )
    if options.workers > 256:
        raise ModelcacheError(f"environment variable MODELCACHE_WORKERS={workers!r} is above the allowed 256")
    problem = chunk_size_problem(options.chunk_size)
    if problem:
        raise ModelcacheError(f"environment variable MODELCACHE_CHUNK_SIZE={chunk!r}: {problem}")
    check_buffers(options.workers, options.chunk_size,
                  f"MODELCACHE_WORKERS={options.workers} x MODELCACHE_CHUNK_SIZE={human_bytes(options.chunk_size)}")
    return options


def _install_log_scrubbing(scrub: Scrubber) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ScrubbingFormatter(scrub))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)


def _fail_all(pairs: list[Pair], cause: str, scrub: Scrubber) -> int:
    """A problem before any download (settings, env): one line per pair, as for pair errors."""
    for pair in pairs:
        print(scrub(f"error: {redact_uri(pair.src)} -> {pair.dest}: {cause}"), file=sys.stderr)
    return 1


def _prepare() -> tuple[Scrubber, Context, float, int]:
    """Settings, scrubber and run context from the environment; raises ModelcacheError."""
    settings = _settings()
    env = settings.env
    scrub = Scrubber.from_env(env)
    if (env.get("CONFIDENTIAL_ENABLED") or "").strip().lower() == "true":
        # KServe decrypts the downloaded files (JWE) afterwards; handing the runtime encrypted
        # bytes as if they were the model would be worse than failing.
        raise ModelcacheError(
            "CONFIDENTIAL_ENABLED=true is not supported (modelcache's initializer cannot decrypt "
            "JWE-encrypted models); use KServe's initializer image"
        )
    try:
        interval = float(env.get("MODELCACHE_PROGRESS_INTERVAL") or 5)
        parallel = int(env.get("MODELCACHE_INIT_PARALLEL") or 4)
    except ValueError:
        raise ModelcacheError("MODELCACHE_PROGRESS_INTERVAL and MODELCACHE_INIT_PARALLEL must be numbers") from None
    if not 0.1 <= interval <= 3600 or not 1 <= parallel <= 64:
        raise ModelcacheError("MODELCACHE_PROGRESS_INTERVAL must be 0.1 to 3600 (seconds) and "
                              "MODELCACHE_INIT_PARALLEL 1 to 64")
    limits = ArchiveLimits.from_env(env)
    ctx = Context(
        settings=settings, limits=limits, tracker=ProgressTracker(), options=transfer_options(env),
        interval=interval,
    )
    return scrub, ctx, interval, parallel


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or len(args) % 2:
        print(USAGE, file=sys.stderr)
        return 1
    pairs = pairs_from_args(args)
    for pair in pairs:
        try:
            os.makedirs(pair.dest, exist_ok=True)
        except OSError as exc:
            return _fail_all([pair], f"cannot create the destination: {describe_error(exc)}", Scrubber())

    try:
        scrub, ctx, interval, parallel = _prepare()
    except ModelcacheError as exc:
        # Messages of ours never carry secret values; scrub URLs in them all the same.
        return _fail_all(pairs, describe_error(exc), Scrubber())

    _install_log_scrubbing(scrub)
    reporter = Reporter(scrub, interval=interval, tracker=ctx.tracker)
    ctx.note = reporter.info
    reporter.start()
    try:
        result = run_pairs(pairs, ctx, reporter, max_parallel=parallel)
    finally:
        reporter.stop()
    reporter.summary(result.ok, result.failed, result.outcomes)
    return 0 if result.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
