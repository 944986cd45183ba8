"""Which handler serves a source: KServe's dispatch order (contracts §5.2), as a registry.

The local cases (a PVC path that is not mounted, a path under the node-cache mount, a local
path or ``file://``) are decided here; every remote scheme goes through the one core path,
``modelcache.pull`` in dest mode, and then the archive step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from initializer import finished, unpacked
from initializer.report import PairOutcome
from modelcache.engine.transfer import TransferOptions
from modelcache.errors import ModelcacheError, NotFoundError, UnsupportedError
from modelcache.runtime.progress import ProgressTracker, human_bytes
from modelcache.runtime.reserved import META_DIR
from modelcache.sources.archive import (
    ArchiveLimits,
    UnpackResult,
    remove_stale_staging,
    single_archive,
    unpack_archive,
)
from modelcache.sources.credentials import Settings
from modelcache.sources.local import check_file_type
from modelcache.sources.uri import parse_uri, redact_uri
from modelcache.store import first_stop

log = logging.getLogger(__name__)

PVC_MOUNT_PREFIX = "/mnt/pvc"
MODEL_MOUNT_DIR = "/mnt/models"
#: Names in DEST the archive step must not overwrite: our own bookkeeping.
RESERVED_NAMES = (META_DIR,)


@dataclass
class Context:
    settings: Settings
    limits: ArchiveLimits
    tracker: ProgressTracker
    options: TransferOptions | None = None
    #: Where informational lines go (the reporter's stdout); silent by default.
    note: Callable[[str], None] = lambda _line: None
    #: Seconds between "unpacking" lines for a long archive.
    interval: float = 5.0


def _unpack(archive: Path, dest: Path, ctx: Context, *, remove_archive: bool = True) -> UnpackResult:
    """Unpack with a plain progress line every ``ctx.interval`` seconds (a 100 GB .tar.gz takes a while)."""
    ctx.note(f"unpacking {archive.name} into {dest}")
    state = {"bytes": 0, "last": time.monotonic()}

    def on_bytes(n: int) -> None:
        state["bytes"] += n
        now = time.monotonic()
        if now - state["last"] >= ctx.interval:
            state["last"] = now
            ctx.note(f"unpacking {archive.name}: {human_bytes(state['bytes'])} written")

    return unpack_archive(
        archive, dest, ctx.limits, remove_archive=remove_archive, reserved=RESERVED_NAMES, on_bytes=on_bytes
    )


Handler = Callable[[str, Path, Context], PairOutcome]
_HANDLERS: list[tuple[str, Callable[[str], bool], Handler]] = []


def handler(name: str, matches: Callable[[str], bool]) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        _HANDLERS.append((name, matches, fn))
        return fn

    return deco


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _local_path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


@handler("pvc-missing", lambda uri: uri.startswith(PVC_MOUNT_PREFIX) and not os.path.exists(uri))
def _pvc_missing(uri: str, dest: Path, ctx: Context) -> PairOutcome:
    raise NotFoundError(f"Cannot locate source uri {uri} for PVC")


# The model was put there by the node cache (or the model agent): nothing to do. Checked
# before the local case so the init container never links the mount into itself.
@handler("model-mount", lambda uri: _under(_local_path(uri), MODEL_MOUNT_DIR))
def _model_mount(uri: str, dest: Path, ctx: Context) -> PairOutcome:
    return PairOutcome(action="no-op")


@handler("local", lambda uri: uri.startswith("file://") or os.path.exists(uri))
def _local(uri: str, dest: Path, ctx: Context) -> PairOutcome:
    return link_local(uri, Path(os.path.abspath(_local_path(uri))), dest, ctx)


@handler("pvc", lambda uri: uri.startswith("pvc://"))
def _pvc(uri: str, dest: Path, ctx: Context) -> PairOutcome:
    # KServe's webhook mounts the claim at /mnt/pvc and rewrites pvc://claim/path to
    # /mnt/pvc/path; a pvc:// URI reaching us means the same mount, rooted at pvc_root.
    from modelcache.sources.uri import PVCLocation

    loc = parse_uri(uri)
    assert isinstance(loc, PVCLocation)
    root = Path(ctx.settings.local.pvc_root)
    for candidate in (root / loc.claim / loc.path, root / loc.path):
        if candidate.exists():
            return link_local(uri, candidate, dest, ctx)
    raise NotFoundError(f"Cannot locate source uri {uri} for PVC (not mounted under {root})")


# KServe matches `https://.+\.git` anywhere in the URI (so raw.githubusercontent.com URLs
# are taken for git repositories). We only treat a path that ends in .git as a repository.
_GIT_REPO = re.compile(r"^https?://[^?#]+\.git/?(?:[?#].*)?$")


@handler("git", lambda uri: bool(_GIT_REPO.match(uri)))
def _git(uri: str, dest: Path, ctx: Context) -> PairOutcome:
    raise UnsupportedError(
        f"{redact_uri(uri)}: cloning git repositories is not supported; point the storage URI at the "
        "model files (e.g. an hf:// repository or an archive URL)"
    )


@handler("pull", lambda uri: True)
def _pull(uri: str, dest: Path, ctx: Context) -> PairOutcome:
    from modelcache.pull import PullRequest, pull
    from modelcache.sources.uri import storage_key
    from modelcache.store import DestStore

    key = storage_key(uri)
    pin = parse_uri(uri).digest_pin()
    for done in (finished.load(dest, key), unpacked.load(dest, key)):
        if done is None:
            continue
        bad = unpacked.problems(dest, done, pin)
        if not bad:
            # Complete from an earlier run: no listing, no request.
            if done.archive:
                with contextlib.suppress(FileNotFoundError):
                    (dest / done.archive).unlink()
            finished.finish(dest, done)
            return PairOutcome("cached", len(done.files), sum(s for _, s in done.files),
                               f"{done.archive} (earlier)" if done.archive else "")
        # Files of ours that are not what we wrote (a same-size change, zeros, a cut copy): they
        # go, so that the pull below fetches them instead of adopting them on their size.
        log.warning("%s: %d file(s) in %s are not what this pair wrote (%s): fetching them again",
                    redact_uri(uri), len(bad), dest, ", ".join(bad[:5]))
        for rel in bad:
            _remove_inside(dest, rel)
    finished.forget(dest, key)  # DEST is about to change: no record may vouch for it meanwhile

    result = pull(uri, PullRequest(dest=dest, settings=ctx.settings, options=ctx.options, progress=ctx.tracker))
    outcome = PairOutcome("cached" if result.cached else "pulled", result.files, result.bytes)
    manifest = DestStore.at(dest).manifest(result.storage_key)
    if manifest is None:
        raise ModelcacheError(f"{redact_uri(uri)}: the download left no manifest in {dest}; run it again")
    names = [f.path for f in manifest.files]
    if single_archive(names) is None or not (dest / names[0]).is_file():
        finished.finish(dest, finished.from_manifest(dest, manifest))
        return outcome
    archive = dest / names[0]
    size = archive.stat().st_size
    res = _unpack(archive, dest, ctx, remove_archive=False)
    replaced = any(p == names[0] for p in res.paths)
    record = unpacked.build(dest, key, "" if replaced else names[0], size, res)
    unpacked.write(dest, record)  # a crash from here on finds the archive unpacked
    if not replaced:
        archive.unlink()
    finished.finish(dest, record)
    return PairOutcome(outcome.action, res.files, res.bytes, f"{names[0]} ({res.files} files)")


def _remove_inside(dest: Path, rel: str) -> None:
    """Remove ``rel`` from DEST without following a link: where a folder on the way is a link
    (or a file), that entry goes instead; what a link points at is never touched."""
    hit = first_stop(dest, rel)
    if hit is not None and not stat.S_ISDIR(hit[1].st_mode):
        hit[0].unlink()


def link_local(uri: str, src: Path, dest: Path, ctx: Context) -> PairOutcome:
    """KServe's local case: symlink the top-level entries of ``src`` into ``dest``.

    Names already in ``dest`` are kept. Hidden entries are skipped (KServe globs ``*``). A
    single linked archive is unpacked, and its link removed.
    """
    if not src.exists():
        raise NotFoundError(f"Local path {uri} does not exist.")
    entries = sorted(p for p in src.iterdir() if not p.name.startswith(".")) if src.is_dir() else [src]
    if not entries:
        raise NotFoundError(f"Failed to fetch model. No model found in {uri}.")
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):  # a dangling link is linked as KServe does
            check_file_type(entry, entry.stat().st_mode, redact_uri(uri))
    for entry in entries:
        target = dest / entry.name
        if not os.path.lexists(target):
            os.symlink(entry, target)
    if single_archive([e.name for e in entries]) is not None:
        res = _unpack(dest / entries[0].name, dest, ctx)
        return PairOutcome("linked", res.files, res.bytes, f"{entries[0].name} ({res.files} files)")
    return PairOutcome("linked", files=len(entries))


def run_pair(uri: str, dest: Path, ctx: Context) -> PairOutcome:
    dest.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(dest)
    for _name, matches, fn in _HANDLERS:
        if matches(uri):
            return fn(uri, dest, ctx)
    raise ModelcacheError(f"no handler for {uri}")  # unreachable: "pull" matches everything
