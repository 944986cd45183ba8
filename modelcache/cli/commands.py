"""The ``modelcache`` command: pull, ls, verify, rm, gc.

Every failure is one line on stderr (``error: ...``). Exit codes: 0 done; 1 a model failed
(or verify found damage, or rm found nothing to remove); 2 a bad flag value or an environment
that cannot work (a missing root, too little memory for the buffers); 130 interrupted by Ctrl-C
(staged bytes are kept: the same command resumes). ``--json`` prints machine-readable results
on stdout. Progress goes to stderr: bars on a terminal, one plain line every few seconds
otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from modelcache.cli.options import (
    LEVELS,
    SizeType,
    assume_unused_option,
    check_chunk_size,
    emit,
    fail,
    folder_name,
    key_of,
    log_level_option,
    mount_guard_for,
    not_stored,
    open_store,
    root_option,
)
from modelcache.engine.resources import MAX_CHUNK, MIN_CHUNK, check_buffers
from modelcache.engine.transfer import TransferOptions
from modelcache.errors import ModelcacheError, SourceChangedError
from modelcache.runtime.clock import rfc3339
from modelcache.runtime.logs import setup_cli_logging
from modelcache.runtime.progress import ProgressTracker, human_bytes, plural
from modelcache.runtime.redact import redact_uri, scrub_urls
from modelcache.runtime.startup import StartupError, run_command
from modelcache.sources.uri import parse_uri
from modelcache.store import DestLayout, DestStore, NodeLayout, NodeStore


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--log-level", default="WARNING", envvar="MODELCACHE_LOG_LEVEL", show_default=True, show_envvar=True,
              type=LEVELS, help="Log level, before or after the sub-command.")
@click.version_option(package_name="modelcache")
def cli(log_level: str) -> None:
    """Put model weights onto serving machines: fast, verified, crash-safe.

    Exit codes: 0 done; 1 a model failed, verify found damage, or rm found nothing; 2 a bad flag
    or environment (missing root, too little memory); 130 interrupted (staged bytes are kept).
    """
    setup_cli_logging(log_level)


def _twins(uris: list[str], root: Path) -> list[str]:
    """Notes for URIs that name a source already stored under another spelling."""
    store = NodeStore.at(root)
    try:
        stored = [(e.storage_key, e.uri) for e in store.entries()] if root.is_dir() else []
    except ModelcacheError:
        return []
    known: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for key, uri in stored:
        try:
            known.setdefault(parse_uri(uri).identity, []).append((key, uri))
        except ModelcacheError:
            continue
    notes = []
    for uri in uris:
        try:
            loc = parse_uri(uri)
        except ModelcacheError:
            continue
        for key, other in known.get(parse_uri(loc.display).identity, []):
            if key != loc.storage_key:
                notes.append(f"note: {loc.display} is the same source as {other} (stored as {key}); it is stored "
                             "separately because KServe keys a model by the URI's exact text: use one spelling "
                             "to keep one copy")
    return notes


@contextmanager
def _interruptible() -> Iterator[tuple[threading.Event, list[int]]]:
    """Ctrl-C (or SIGTERM) cancels the transfer cleanly: the staged bytes stay for a resume. A
    second Ctrl-C stops at once."""
    cancel, caught = threading.Event(), list[int]()

    def on_signal(signum: int, _frame: Any) -> None:
        if caught:
            raise KeyboardInterrupt
        caught.append(signum)
        cancel.set()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield cancel, caught
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@cli.command()
@log_level_option
@click.argument("uris", nargs=-1)
@root_option
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write one model straight into this folder instead of the store (not with --root).")
@click.option("--workers", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Parallel streams (memory: (workers + workers/2) x chunk size).")
@click.option("--max-workers", type=click.IntRange(1, 256), default=None,
              help="Grow up to this many streams while throughput grows (servers that cap each "
              "connection, e.g. S3); at least --workers; default: a fixed --workers.")
@click.option("--chunk-size", type=SizeType(), default="8M", show_default=True, callback=check_chunk_size,
              help=f"Bytes per ranged read and per resume unit, {human_bytes(MIN_CHUNK)} to {human_bytes(MAX_CHUNK)} "
              "(e.g. 8M, 64MiB).")
@click.option("--stall-timeout", type=click.FloatRange(0.5, 3600), default=30.0, show_default=True,
              help="Seconds without bytes before a read is aborted and retried (0.5 to 3600).")
@click.option("--max-attempts", type=click.IntRange(1, 100), default=6, show_default=True,
              help="Failures in a row without progress before a read gives up.")
@click.option("--direct-io/--no-direct-io", default=None, help="Force O_DIRECT writes on or off (default: auto).")
@click.option("--progress", "progress_mode", type=click.Choice(["auto", "bar", "plain", "none"]), default="auto",
              show_default=True, help="Bars on a terminal, a log line every few seconds otherwise.")
@click.option("--progress-interval", type=click.FloatRange(0.1, 3600), default=5.0,
              envvar="MODELCACHE_PROGRESS_INTERVAL", show_envvar=True, show_default=True,
              help="Seconds between plain progress lines (0.1 to 3600).")
@click.option("--check", is_flag=True,
              help="Download nothing: say for each model (the URIs given, else every stored one) whether its "
              "source still matches what is stored.")
@click.option("--refresh", is_flag=True,
              help="Bring stored models (the URIs given, else all) up to date with their source, fetching only the "
              "files that changed.")
# 64Mi: modelcache.pull.SPACE_MARGIN (not imported here: the CLI imports the pull only when it pulls).
@click.option("--space-margin", type=SizeType(), default="64Mi",
              envvar="MODELCACHE_SPACE_MARGIN", show_envvar=True, show_default=True,
              help="Kept free on the file system besides the model (the agent's --space-margin on a node).")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON on stdout.")
@assume_unused_option
@click.pass_context
def pull(ctx: click.Context, uris: tuple[str, ...], root: Path, dest: Path | None, workers: int,
         max_workers: int | None, chunk_size: int, stall_timeout: float, max_attempts: int, direct_io: bool | None,
         progress_mode: str, progress_interval: float, check: bool, refresh: bool, space_margin: int, as_json: bool,
         assume_unused: bool) -> None:
    """Download models (one per URI) into the store, verified and resumable.

    A stored model is answered from the store without asking its source; `--check` compares it
    with the source (no download) and `--refresh` brings it up to date.
    """
    from modelcache.cli.display import show_progress
    from modelcache.pull import PullRequest, PullResult, SpacePolicy, pull_many

    if (check or refresh) and dest is not None:
        raise click.UsageError("--check and --refresh work on a store (--root), not on --dest")
    if check and refresh:
        raise click.UsageError("--check and --refresh exclude each other: --check only reports")
    if check:
        _check(open_store(root), list(uris), root, as_json)
        return
    if refresh and not uris:
        uris = tuple(_stored_uris(open_store(root)))
        if not uris:
            click.echo(f"no models in {root}")
            return
    if not uris:
        raise click.UsageError("give at least one URI to pull")
    if dest is not None and ctx.get_parameter_source("root") == ParameterSource.COMMANDLINE:
        raise click.UsageError("--root and --dest exclude each other: --dest writes one model straight into a "
                               "folder, --root keeps models in a store")
    if dest is not None and len(set(uris)) > 1:
        raise click.UsageError(f"--dest holds one model, {len(set(uris))} URIs were given: pull several into a store "
                               "(--root)")
    if dest is None and ctx.get_parameter_source("root") == ParameterSource.DEFAULT and not check:
        click.echo(f"note: no --root given (nor MODELCACHE_ROOT): pulling into the default store {root}", err=True)
    if max_workers is not None and max_workers < workers:
        raise click.BadParameter(f"{max_workers} is below --workers {workers}", param_hint="'--max-workers'")
    try:
        check_buffers(max_workers or workers, chunk_size,
                      f"--workers {max_workers or workers} x --chunk-size {human_bytes(chunk_size)}")
    except ModelcacheError as exc:
        raise StartupError(str(exc)) from None
    options = TransferOptions(workers=workers, max_workers=max_workers, chunk_size=chunk_size,
                              stall_timeout=stall_timeout, max_attempts=max_attempts, direct_io=direct_io)
    if dest is None:
        for note in _twins(list(uris), root):
            click.echo(note, err=True)
    tracker = ProgressTracker()
    with _interruptible() as (cancel, caught):
        try:
            with show_progress(tracker, progress_mode, progress_interval):
                results = pull_many(list(uris), PullRequest(
                    root=None if dest else root, dest=dest, options=options, progress=tracker, cancel=cancel,
                    guard=mount_guard_for(assume_unused), refresh=refresh, space=SpacePolicy(space_margin)))
        except ModelcacheError as exc:
            if not caught:
                fail(str(exc))
            results = []
    if dest is not None and results and all(isinstance(r, PullResult) for r in results):
        # DEST holds the model and nothing else (as the init container leaves it): a second pull
        # into it checks its files against the source instead of trusting a manifest.
        DestStore.at(dest).clear_bookkeeping()
    failed = False
    out = []
    for uri, res in zip(uris, results, strict=True):
        if isinstance(res, PullResult):
            out.append({**asdict(res), "path": str(res.path), "ok": True})
            if not as_json:
                how = "cached" if res.cached else f"in {res.elapsed:.1f}s"
                if refresh:
                    how = "up to date" if res.cached else (
                        f"refreshed in {res.elapsed:.1f}s: {len(res.refreshed)} file(s) fetched again"
                        + (f" ({', '.join(res.refreshed[:3])}{', ...' if len(res.refreshed) > 3 else ''})"
                           if res.refreshed else "")
                        + (f", {len(res.dropped)} dropped" if res.dropped else ""))
                checked = f", {'+'.join(res.verified)} verified" if res.verified else ""
                click.echo(f"{res.uri} -> {res.path} ({plural(res.files, 'file')}, {human_bytes(res.bytes)}, {how}"
                           f"{checked})",
                           err=True)
                for line in _pull_notes(res):
                    click.echo(f"{res.storage_key}: {line}", err=True)
        elif caught:
            continue  # one line for the interruption below, not one "cancelled" per model
        else:
            failed = True
            shown = str(res) if isinstance(res, ModelcacheError) else f"{redact_uri(uri)}: {res!r}"
            shown = scrub_urls(shown)  # an SDK's own error may quote a signed URL
            out.append({"uri": redact_uri(uri), "ok": False, "error": shown, "reason": getattr(res, "reason", "Error")})
            click.echo(f"error: {shown}", err=True)
    if as_json:
        emit(out)
    if caught:
        _interrupted(tracker, DestLayout(dest).staging_root if dest is not None else NodeLayout(root).staging_root,
                     caught[0])
    sys.exit(1 if failed else 0)


def _names(paths: tuple[str, ...]) -> str:
    return ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")


def _pull_notes(res: Any) -> list[str]:
    """What a pull did beyond fetching: damaged stored files fetched again, files kept unverified,
    files moved out of an adopted folder."""
    notes = []
    if res.refetched:
        notes.append(f"{len(res.refetched)} stored file(s) no longer matched their digests and were fetched again "
                     f"({_names(res.refetched)})")
    if res.unverified and not res.cached:
        notes.append(f"unverified: {len(res.unverified)} file(s) kept on their size alone ({_names(res.unverified)}): "
                     "the source gives no checksum; `modelcache pull --refresh` fetches them again")
    if res.set_aside:
        notes.append(f"{len(res.set_aside)} file(s) the source does not list moved out of the model folder to "
                     f"{res.set_aside_to} ({_names(res.set_aside)})")
    return notes


def _stored_uris(store: NodeStore) -> list[str]:
    """The URIs of the stored models. One stored without the secret part of its URI (a signed
    query) cannot be listed again from the manifest: it is named, to be given in full."""
    out = []
    keys = store.keys()
    for key in keys:
        m = store.manifest(key)
        if m is None:
            continue
        if "<redacted>" in m.uri:
            click.echo(f"error: {key} ({m.uri}): stored without the secret part of its URI; name the URI itself "
                       "to refresh it", err=True)
            continue
        out.append(m.uri)
    return out


def _check(store: NodeStore, args: list[str], root: Path, as_json: bool) -> None:
    """``pull --check``: each model's source listed and compared with its manifest, nothing fetched."""
    from modelcache.drift import CHANGED, ERROR, Drift
    from modelcache.pull import check_drift
    from modelcache.sources.credentials import Settings

    settings = Settings.from_env()
    keys = store.keys()
    targets = [(key_of(a), a if not re.fullmatch(r"[0-9a-f]{16}", a) else None) for a in args] or [
        (k, None) for k in keys]
    out: list[Drift] = []
    for key, uri in targets:
        manifest = store.manifest(key)
        shown = redact_uri(uri) if uri else key
        if manifest is None:
            out.append(Drift(key, shown, ERROR, message=f"not in the store at {root} (pull it first)"))
            continue
        listed = uri or manifest.uri
        if uri is None and "<redacted>" in manifest.uri:
            out.append(Drift(key, manifest.uri, ERROR, message="stored without the secret part of its URI; "
                             "name the URI itself: modelcache pull --check URI"))
            continue
        try:
            out.append(check_drift(listed, manifest, settings))
        except ModelcacheError as exc:
            message = scrub_urls(" ".join(str(exc).split())).removeprefix(f"{redact_uri(listed)}: ")
            out.append(Drift(key, manifest.uri, ERROR, message=message))
    if as_json:
        emit([asdict(d) for d in out])
    else:
        if not out:
            click.echo(f"no models in {root}")
        for d in out:
            click.echo(f"{d.storage_key:16}  {d.state:8}  {d.uri}: {d.message}")
    stale = [d for d in out if d.state == CHANGED]
    if stale and not as_json:
        names = " ".join(d.uri if "<redacted>" not in d.uri else d.storage_key for d in stale)
        click.echo(f"{len(stale)} model(s) changed at the source; bring them up to date (only changed files are "
                   f"fetched): modelcache pull --refresh --root {root} {names}", err=True)
    if any(d.state in (CHANGED, ERROR) for d in out):
        sys.exit(1)


def _interrupted(tracker: ProgressTracker, staging: Path, signum: int) -> None:
    """The interrupt's one line: what the next run resumes from. A file from a server that ignores
    Range is read as one stream and cannot resume: what arrived of it is not promised back."""
    snap = tracker.snapshot()
    lost = snap.bytes_unresumable
    kept = snap.bytes_done - lost
    if not snap.bytes_done:
        line = "nothing was downloaded yet; run the same command again to start"
    elif not lost:
        line = (f"{human_bytes(kept)} of {human_bytes(snap.bytes_total)} are staged in {staging} and kept; run the "
                "same command again to resume from there")
    elif kept:
        line = (f"{human_bytes(kept)} of {human_bytes(snap.bytes_total)} are staged in {staging} and kept; run the "
                f"same command again to resume from there. The other {human_bytes(lost)} that arrived start over: "
                "the server ignores Range requests, so a file of it is read whole, from byte 0")
    else:
        line = (f"nothing can be resumed: the server ignores Range requests, so the next run downloads the "
                f"{human_bytes(lost)} that arrived again from byte 0 (a server that honours Range resumes)")
    click.echo(f"error: interrupted: {line}", err=True)
    sys.exit(128 + signum)


@cli.command("ls")
@log_level_option
@root_option
@click.option("--json", "as_json", is_flag=True)
def ls_cmd(root: Path, as_json: bool) -> None:
    """List the models in the store, and pulls in flight or interrupted (with their percentage)."""
    from modelcache.pull import staged_pulls

    store = open_store(root)
    try:
        entries = store.entries()
        staged = staged_pulls(store)
    except ModelcacheError as exc:
        fail(str(exc))
        return
    present = {e.storage_key for e in entries if e.present}
    staged = [s for s in staged if s.storage_key not in present]
    stage_keys = {s.storage_key for s in staged}
    if as_json:
        emit([{**asdict(e), "state": _entry_state(e), "last_used": e.last_used_at}
               for e in entries if e.present or e.storage_key not in stage_keys]
              + [{**asdict(s), "state": s.state, "present": False} for s in staged])
        return
    if not entries and not staged:
        click.echo(f"no models in {root}")
        return
    click.echo(f"{'KEY':16}  {'STATE':16}  {'SIZE':>10}  {'FILES':>5}  URI")
    for e in entries:
        if e.storage_key in stage_keys:
            continue  # shown below with its progress
        uri = e.uri if e.made else "(not made by modelcache" + (
            ": a pull of the URI with this key adopts its files)" if re.fullmatch(r"[0-9a-f]{16}", e.storage_key)
            else ")")
        click.echo(f"{e.storage_key:16}  {_entry_state(e):16}  {human_bytes(e.size):>10}  {e.files:>5}  {uri}")
    for s in staged:
        state = f"{s.state} {s.percent:.0f}%"
        click.echo(f"{s.storage_key:16}  {state:16}  {human_bytes(s.bytes_total):>10}  {s.files:>5}  {s.uri}")
    if any(s.state == "interrupted" for s in staged):
        click.echo(f"interrupted pulls resume where they stopped: run `modelcache pull --root {root} URI` again",
                   err=True)
    for s in staged:
        if s.state == "failed":
            click.echo(f"{s.storage_key}: failed: {s.failure}; what it staged is kept: `modelcache pull --root "
                       f"{root} {s.uri or 'URI'}` resumes once the cause is fixed, `modelcache rm --root {root} "
                       f"{s.storage_key}` drops it", err=True)
    if any(e.damaged and e.storage_key not in stage_keys for e in entries):
        click.echo(f"damaged: `modelcache verify --repair --root {root} KEY` fixes the damaged files in place, at the "
                   f"stored revision; `modelcache pull --root {root} URI` fetches them again at the source's current "
                   "one", err=True)
    if any(e.present and e.unverified for e in entries):
        click.echo("unverified: adopted files kept on their size alone (the source gives no checksum); "
                   f"`modelcache pull --refresh --root {root} URI` fetches them again", err=True)
    foreign = [e.storage_key for e in entries if not e.made]
    if foreign:
        click.echo(f"{len(foreign)} folder(s) under {root}/models were not made by modelcache ({', '.join(foreign)}): "
                   f"gc and the agent never delete them; `modelcache rm --root {root} NAME` deletes one", err=True)


def _entry_state(e: Any) -> str:
    """What ``ls`` calls a model: present (unverified: some files adopted on their size alone),
    damaged, incomplete, or a folder modelcache did not make."""
    if not e.made:
        return "not modelcache's"
    if e.present:
        return "unverified" if e.unverified else "present"
    return "damaged" if e.damaged else "incomplete"


@cli.command()
@log_level_option
@click.argument("models", nargs=-1)
@root_option
@click.option("--repair", "fix", is_flag=True,
              help="Fetch the damaged or missing files of each damaged model again (only those, at the revision "
              "its manifest names) and put them in place; the model folder itself stays.")
@click.option("--progress", "progress_mode", type=click.Choice(["auto", "bar", "plain", "none"]), default="auto",
              show_default=True, help="Progress of a repair's downloads.")
@click.option("--json", "as_json", is_flag=True)
def verify(models: tuple[str, ...], root: Path, fix: bool, progress_mode: str, as_json: bool) -> None:
    """Re-hash models (all by default) and compare with their manifests."""
    store = open_store(root)
    given = {key_of(m): m for m in models}
    # A key or URI with nothing in the store is a typo, not damage: said as `rm` says it, and
    # never answered with a repair (of nothing) or a pull (of a key).
    unknown = [m for k, m in given.items() if not store.has(k)]
    for m in unknown:
        not_stored(m, root)
    given = {k: m for k, m in given.items() if m not in unknown}
    if unknown and not given:
        sys.exit(1)
    everything = store.keys()
    keys = list(given) or [k for k in everything if store.made(k)]
    report = {k: [asdict(p) for p in store.verify(k)] for k in keys}
    for k, problems in report.items():
        if problems and store.manifest(k) is not None:
            _mark(store, k, problems)
    if as_json and not fix:
        emit(report)
    else:
        for k, problems in report.items():
            if problems:
                for p in problems:
                    click.echo(f"{k}: {p['path'] or '-'}: {p['problem']}")
            else:
                click.echo(f"{k}: ok")
        for k in [] if given else sorted(set(everything) - set(keys)):
            click.echo(f"{k}: not made by modelcache: nothing to verify it against (skipped)")
        if not keys:
            click.echo(f"no models in {root}")
    damaged = [k for k, p in report.items() if p]
    if damaged and fix:
        failed = [k for k in damaged if not _repair(store, k, given.get(k), progress_mode)]
        if as_json:
            emit({k: [asdict(p) for p in store.verify(k)] for k in keys})
        if failed:
            click.echo(f"error: {len(failed)} of {len(damaged)} damaged model(s) not repaired", err=True)
            sys.exit(1)
        if unknown:
            sys.exit(1)
        return
    if damaged:
        names = " ".join(given.get(k, k) for k in damaged)
        click.echo(f"error: {len(damaged)} model(s) failed verification; fetch their damaged files again (nothing "
                   f"else is downloaded): modelcache verify --repair --root {root} {names}", err=True)
        sys.exit(1)
    if unknown:
        sys.exit(1)


def _mark(store: NodeStore, key: str, problems: list[dict[str, str]]) -> None:
    """Damage that verify found is recorded: the model stops being present, and the next pull (or
    ``verify --repair``) fetches exactly those files again. A model another process holds, or a
    store this user cannot write, is left as it is (the report says what is wrong either way)."""
    reason = "; ".join(f"{p['path']}: {p['problem']}" for p in problems[:3])
    try:
        with store.lock(key, blocking=False):
            store.mark_damaged(key, [p["path"] for p in problems if p["path"]], f"verify found damage: {reason}")
    except ModelcacheError as exc:
        logging.getLogger("modelcache.cli.commands").info("%s: damage not recorded: %s", key, exc)


def _repair(store: NodeStore, key: str, given: str | None, progress_mode: str) -> bool:
    """``verify --repair`` of one model: the agent's in-place repair (modelcache.repair), from here."""
    from modelcache.cli.display import show_progress
    from modelcache.pull import PullRequest, pull
    from modelcache.repair import repair
    from modelcache.sources.credentials import Settings

    manifest = store.manifest(key) or store.pinned_manifest(key)
    uri = given if given and given != key else (manifest.uri if manifest else None)
    if uri is None or "<redacted>" in uri:
        why = "it has no manifest to name its URI" if manifest is None else "it was stored without the secret part " \
            "of its URI"
        click.echo(f"error: {key}: cannot repair: {why}; name the URI: modelcache verify --repair URI", err=True)
        return False
    if not store.layout.model_dir(key).is_dir():
        click.echo(f"error: {key}: its folder is not in the store at {store.layout.root}; pull it again: modelcache "
                   f"pull --root {store.layout.root} {redact_uri(uri)}", err=True)
        return False
    settings = Settings.from_env()
    tracker = ProgressTracker()

    def pull_into(dest: Path, at: str | None, check: Any, only: Any) -> Any:
        return pull(at or uri, PullRequest(dest=dest, settings=settings, progress=tracker, admit=check, only=only))

    try:
        with store.lock(key, blocking=False):
            old = store.pin_damaged(key)  # not present for any reader until the repair is installed
        with show_progress(tracker, progress_mode, 5.0):
            out = repair(store, key, pull_into, [f.path for f in old.files] if old else [])
    except SourceChangedError as exc:
        click.echo(f"error: {key}: {scrub_urls(' '.join(str(exc).split()))}", err=True)
        click.echo(f"{key}: kept as it is, marked damaged (not present); `modelcache pull --root {store.layout.base} "
                   f"{redact_uri(uri)}` takes the source's current revision instead: the damaged and changed files "
                   "are fetched, the others checked against their digests and kept, and the folder replaced whole",
                   err=True)
        return False
    except ModelcacheError as exc:
        click.echo(f"error: {key}: {scrub_urls(' '.join(str(exc).split()))}", err=True)
        return False
    shown = ", ".join(out.replaced[:5]) + (", ..." if len(out.replaced) > 5 else "")
    click.echo(f"{key}: repaired in place: {len(out.replaced)} file(s) fetched again"
               + (f" ({shown})" if shown else "") + (f", {len(out.removed)} removed" if out.removed else ""))
    return True


@cli.command()
@log_level_option
@click.argument("models", nargs=-1, required=True)
@root_option
@click.option("--json", "as_json", is_flag=True)
@assume_unused_option
def rm(models: tuple[str, ...], root: Path, as_json: bool, assume_unused: bool) -> None:
    """Remove models (by storage key or URI) from the store; never one a pod on this node mounts."""
    store = open_store(root, assume_unused)
    out: dict[str, tuple[str, bool, bool]] = {}  # argument -> (key, removed, made by modelcache)
    for m in models:
        key = folder_name(root, m) or key_of(m)
        if not store.has(key):  # nothing to lock either: no lock file is created for a typo
            out[m] = (key, False, True)
            continue
        made = store.made(key)
        try:
            out[m] = (key, store.remove(key), made)
        except ModelcacheError as exc:
            fail(f"{m}: {exc}")
    if as_json:
        emit([{"model": redact_uri(m), "storage_key": key, "removed": removed, "made_by_modelcache": made}
               for m, (key, removed, made) in out.items()])
    else:
        for m, (_, removed, made) in out.items():
            if removed:
                click.echo(f"{m}: removed" + ("" if made else " (a folder not made by modelcache)"))
    missing = [m for m, (_k, removed, _made) in out.items() if not removed]
    for m in missing:
        not_stored(m, root)
    if missing:
        sys.exit(1)


@cli.command()
@log_level_option
@root_option
@click.option("--target-free", type=SizeType(), required=True, help="Evict until this much space is free.")
@click.option("--evict-all", is_flag=True,
              help="Evict every model not in use even if that cannot reach --target-free (else nothing is evicted).")
@click.option("--dry-run", is_flag=True, help="Say what would be evicted, evict nothing.")
@click.option("--json", "as_json", is_flag=True)
@assume_unused_option
def gc(root: Path, target_free: int, evict_all: bool, dry_run: bool, as_json: bool, assume_unused: bool) -> None:
    """Evict least recently used models until --target-free bytes are free (skipping mounted ones)."""
    store = open_store(root, assume_unused)
    try:
        evicted = store.gc(target_free, dry_run=dry_run, evict_all=evict_all)
    except ModelcacheError as exc:
        fail(f"gc at {root}: {exc}" + (" (dry run)" if dry_run else ""))
        return
    if as_json:
        emit({"dry_run": dry_run, "evicted": [asdict(e) for e in evicted]})
        return
    verb = "would evict" if dry_run else "evicted"
    for e in evicted:
        click.echo(f"{verb} {e.storage_key} ({human_bytes(e.size)}) {e.uri}")
    free = store.free_bytes() + (sum(e.size for e in evicted) if dry_run else 0)
    if not evicted:
        click.echo(f"nothing to evict: {human_bytes(free)} free, target {human_bytes(target_free)}")
    elif free < target_free:
        click.echo(f"{human_bytes(free)} free{' then' if dry_run else ''}: short of the target "
                   f"{human_bytes(target_free)} (--evict-all)", err=True)


@cli.command()
@log_level_option
@click.option("--kubeconfig", envvar="KUBECONFIG", show_envvar=True, default=None,
              help="Kubeconfig (default: as kubectl finds it).")
@click.option("--kserve-namespace", default="kserve", show_default=True,
              help="KServe's namespace (its inferenceservice-config).")
@click.option("--credentials-namespace", default=None,
              help="Where our agent reads credentials (default: its DaemonSet's setting, else modelcache-credentials).")
@click.option("--json", "as_json", is_flag=True, help="The steps as JSON.")
@click.option("--no-list", "no_list", is_flag=True,
              help="Do not list the caches' sources (by default each is listed from here with the credentials "
                   "the agent will use, and every one that fails is named).")
def migrate(kubeconfig: str | None, kserve_namespace: str, credentials_namespace: str | None, as_json: bool,
            no_list: bool) -> None:
    """Check a cluster for switching from KServe's local model cache to modelcache (before and after),
    and print what to do, in order: comment lines say why, every other line is a command. Exit 0
    when nothing blocks the switch, 1 otherwise. The procedure: deploy/README.md."""
    from modelcache.kube import migrate as mig
    from modelcache.kube.client import Kube, load_api_client

    try:
        api = load_api_client(kubeconfig)
        kube = Kube(api)
        facts = mig.gather(kube, kserve_namespace, credentials_namespace)
        if not no_list:
            # The agent's own credential code (agent/precheck.py), so the listing is the agent's.
            from agent.precheck import check_sources

            facts.sources = check_sources(kube, facts, mig.agent_plain_env(facts.our_agent))
        steps = mig.plan(facts)
    except StartupError as exc:  # no usable kubeconfig: one line naming the file and the fix
        fail(str(exc), 2)
        return
    if as_json:
        emit({"steps": [asdict(s) for s in steps], "blocking": sum(1 for s in steps if s.blocking)})
    else:
        click.echo(mig.render(steps, api.configuration.host))
    sys.exit(1 if any(s.blocking for s in steps) else 0)


@cli.command()
@click.option("--kubeconfig", envvar="KUBECONFIG", show_envvar=True, default=None,
              help="Kubeconfig (default: as kubectl finds it).")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json: the same as one JSON object (one a line with --watch).")
@click.option("-w", "--watch", is_flag=True, help="Print it again every --interval until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.5), default=2.0, show_default=True,
              help="Seconds between two prints with --watch.")
def status(kubeconfig: str | None, output: str, watch: bool, interval: float) -> None:
    """The fleet at a glance, from the cluster's LocalModelCaches and LocalModelNodes: per cache its
    copies by node group, per node free space, models and what is in flight (rate, ETA), and every
    failure with its cause."""
    import time

    from modelcache.kube.client import Kube, load_api_client
    from modelcache.kube.fleet import gather, render

    try:
        kube = Kube(load_api_client(kubeconfig))
    except StartupError as exc:  # no usable kubeconfig: one line naming the file and the fix
        fail(str(exc), 2)
        return
    while True:
        try:
            fleet = gather(kube)
        except Exception as exc:
            fail(f"cannot read the fleet from {kube.api_client.configuration.host}: {exc}".splitlines()[0], 2)
            return
        if output == "json":
            data = {"time": rfc3339(), **fleet.to_dict()}
            click.echo(json.dumps(data, default=str) if watch else json.dumps(data, indent=1, default=str))
        else:
            if watch:
                click.clear()
                click.echo(f"{rfc3339()}  every {interval:g}s  (Ctrl-C to stop)\n")
            click.echo(render(fleet))
        if not watch:
            return
        time.sleep(interval)


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run_command(cli, "modelcache")


if __name__ == "__main__":
    main()
