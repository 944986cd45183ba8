"""The ``modelcache`` command: pull, ls, verify, rm, gc.

Every failure is one line on stderr (``error: ...``) and a non-zero exit; ``--json`` prints
machine-readable results on stdout. Progress goes to stderr: bars on a terminal, one plain
line every few seconds otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from modelcache.errors import ModelcacheError
from modelcache.progress import ProgressTracker, human_bytes
from modelcache.redact import redact_uri, scrub_urls
from modelcache.sizes import parse_size
from modelcache.store import NodeStore
from modelcache.transfer import TransferOptions
from modelcache.uri import storage_key

DEFAULT_ROOT = "/mnt/models"
class SizeType(click.ParamType):
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {scrub_urls(message)}", err=True)
    sys.exit(code)


def _emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=1, default=str))


def _root_option(f: Any) -> Any:
    return click.option(
        "--root", type=click.Path(file_okay=False, path_type=Path), envvar="MODELCACHE_ROOT",
        default=DEFAULT_ROOT, show_default=True, help="Node store root.",
    )(f)


def _assume_unused_option(f: Any) -> Any:
    return click.option(
        "--assume-unused", is_flag=True,
        help="Where the CLI cannot see every mount on the node (not root, or a container without "
        "hostPID), assume no pod mounts the models it replaces or deletes.",
    )(f)


def _guard(assume_unused: bool) -> Any:
    """No model folder that a pod on this node mounts is replaced or deleted (modelcache.mountusers)."""
    from modelcache.mountusers import mount_guard

    return mount_guard(assume_unused)


def _key(arg: str) -> str:
    """Commands take a storage key or the URI it was pulled from."""
    return arg if re.fullmatch(r"[0-9a-f]{16}", arg) else storage_key(arg)


@click.group()
@click.option("--log-level", default="WARNING", envvar="MODELCACHE_LOG_LEVEL", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.version_option(package_name="modelcache")
def cli(log_level: str) -> None:
    """Put model weights onto serving machines: fast, verified, crash-safe."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


@cli.command()
@click.argument("uris", nargs=-1, required=True)
@_root_option
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write one model straight into this folder instead of the store.")
@click.option("--workers", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Parallel streams (memory: (workers + workers/2) x chunk size).")
@click.option("--max-workers", type=click.IntRange(1, 256), default=None,
              help="Grow up to this many streams while throughput grows (servers that cap each "
              "connection, e.g. S3); default: a fixed --workers.")
@click.option("--chunk-size", type=SizeType(), default="16M", show_default=True,
              help="Bytes per ranged read and per resume unit (e.g. 8M, 64MiB).")
@click.option("--stall-timeout", type=float, default=30.0, show_default=True,
              help="Seconds without bytes before a read is aborted and retried.")
@click.option("--max-attempts", type=click.IntRange(1, 100), default=6, show_default=True,
              help="Failures in a row without progress before a read gives up.")
@click.option("--direct-io/--no-direct-io", default=None, help="Force O_DIRECT writes on or off (default: auto).")
@click.option("--progress", "progress_mode", type=click.Choice(["auto", "bar", "plain", "none"]), default="auto",
              show_default=True, help="Bars on a terminal, a log line every few seconds otherwise.")
@click.option("--progress-interval", type=float, default=5.0, envvar="MODELCACHE_PROGRESS_INTERVAL",
              show_default=True, help="Seconds between plain progress lines.")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON on stdout.")
@_assume_unused_option
def pull(uris: tuple[str, ...], root: Path, dest: Path | None, workers: int, max_workers: int | None,
         chunk_size: int, stall_timeout: float,
         max_attempts: int, direct_io: bool | None, progress_mode: str, progress_interval: float,
         as_json: bool, assume_unused: bool) -> None:
    """Download models (one per URI) into the store, verified and resumable."""
    from modelcache.display import show_progress
    from modelcache.pull import PullResult, pull_many

    options = TransferOptions(workers=workers, max_workers=max_workers, chunk_size=chunk_size,
                              stall_timeout=stall_timeout, max_attempts=max_attempts, direct_io=direct_io)
    tracker = ProgressTracker()
    try:
        with show_progress(tracker, progress_mode, progress_interval):
            results = pull_many(list(uris), root=None if dest else root, dest=dest, options=options,
                                progress=tracker, guard=_guard(assume_unused))
    except ModelcacheError as exc:
        _fail(str(exc))
        return
    failed = False
    out = []
    for uri, res in zip(uris, results, strict=True):
        if isinstance(res, PullResult):
            out.append({**asdict(res), "path": str(res.path), "ok": True})
            if not as_json:
                how = "cached" if res.cached else f"in {res.elapsed:.1f}s"
                checked = f", {'+'.join(res.verified)} verified" if res.verified else ""
                click.echo(f"{res.uri} -> {res.path} ({res.files} files, {human_bytes(res.bytes)}, {how}{checked})",
                           err=True)
        else:
            failed = True
            shown = str(res) if isinstance(res, ModelcacheError) else f"{redact_uri(uri)}: {res!r}"
            shown = scrub_urls(shown)  # an SDK's own error may quote a signed URL
            out.append({"uri": redact_uri(uri), "ok": False, "error": shown, "reason": getattr(res, "reason", "Error")})
            click.echo(f"error: {shown}", err=True)
    if as_json:
        _emit(out)
    sys.exit(1 if failed else 0)


@cli.command("ls")
@_root_option
@click.option("--json", "as_json", is_flag=True)
def ls_cmd(root: Path, as_json: bool) -> None:
    """List the models in the store."""
    try:
        entries = NodeStore.at(root).entries() if root.exists() else []
    except ModelcacheError as exc:
        _fail(str(exc))
        return
    if as_json:
        _emit([asdict(e) for e in entries])
        return
    if not entries:
        click.echo(f"no models in {root}")
        return
    click.echo(f"{'KEY':16}  {'STATE':10}  {'SIZE':>10}  {'FILES':>5}  URI")
    for e in entries:
        state = "present" if e.present else "incomplete"
        click.echo(f"{e.storage_key:16}  {state:10}  {human_bytes(e.size):>10}  {e.files:>5}  {e.uri}")


@cli.command()
@click.argument("models", nargs=-1)
@_root_option
@click.option("--json", "as_json", is_flag=True)
def verify(models: tuple[str, ...], root: Path, as_json: bool) -> None:
    """Re-hash models (all by default) and compare with their manifests."""
    store = NodeStore.at(root)
    keys = [_key(m) for m in models] or store.keys()
    report = {k: [asdict(p) for p in store.verify(k)] for k in keys}
    if as_json:
        _emit(report)
    else:
        for k, problems in report.items():
            if problems:
                for p in problems:
                    click.echo(f"{k}: {p['path'] or '-'}: {p['problem']}")
            else:
                click.echo(f"{k}: ok")
    if any(report.values()):
        click.echo(f"error: {sum(1 for p in report.values() if p)} model(s) failed verification", err=True)
        sys.exit(1)


@cli.command()
@click.argument("models", nargs=-1, required=True)
@_root_option
@click.option("--json", "as_json", is_flag=True)
@_assume_unused_option
def rm(models: tuple[str, ...], root: Path, as_json: bool, assume_unused: bool) -> None:
    """Remove models (by storage key or URI) from the store; never one a pod on this node mounts."""
    store = NodeStore.at(root, guard=_guard(assume_unused))
    out = {}
    for m in models:
        try:
            out[m] = store.remove(_key(m))
        except ModelcacheError as exc:
            _fail(f"{m}: {exc}")
    if as_json:
        _emit(out)
    else:
        for m, removed in out.items():
            click.echo(f"{m}: {'removed' if removed else 'not in the store'}")


@cli.command()
@_root_option
@click.option("--target-free", type=SizeType(), required=True, help="Evict until this much space is free.")
@click.option("--dry-run", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@_assume_unused_option
def gc(root: Path, target_free: int, dry_run: bool, as_json: bool, assume_unused: bool) -> None:
    """Evict least recently used models until --target-free bytes are free (skipping mounted ones)."""
    try:
        evicted = NodeStore.at(root, guard=_guard(assume_unused)).gc(target_free, dry_run=dry_run)
    except ModelcacheError as exc:
        _fail(str(exc))
        return
    if as_json:
        _emit({"dry_run": dry_run, "evicted": [asdict(e) for e in evicted]})
        return
    verb = "would evict" if dry_run else "evicted"
    for e in evicted:
        click.echo(f"{verb} {e.storage_key} ({human_bytes(e.size)}) {e.uri}")
    if not evicted:
        click.echo(f"nothing to evict: {human_bytes(target_free)} free target already met or nothing evictable")


@cli.command()
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None, help="Kubeconfig (default: as kubectl finds it).")
@click.option("--kserve-namespace", default="kserve", show_default=True,
              help="KServe's namespace (its inferenceservice-config).")
@click.option("--credentials-namespace", default=None,
              help="Where our agent reads credentials (default: its DaemonSet's setting, else modelcache-credentials).")
@click.option("--json", "as_json", is_flag=True, help="The steps as JSON.")
def migrate(kubeconfig: str | None, kserve_namespace: str, credentials_namespace: str | None, as_json: bool) -> None:
    """Check a cluster for switching from KServe's local model cache to modelcache (before and after),
    and print what to do, in order: comment lines say why, every other line is a command. Exit 0
    when nothing blocks the switch, 1 otherwise. The procedure: deploy/README.md."""
    from modelcache.kube import migrate as mig
    from modelcache.kube.client import Kube, load_api_client
    from modelcache.startup import StartupError

    try:
        api = load_api_client(kubeconfig)
        steps = mig.plan(mig.gather(Kube(api), kserve_namespace, credentials_namespace))
    except StartupError as exc:  # no usable kubeconfig: one line naming the file and the fix
        _fail(str(exc), 2)
        return
    if as_json:
        _emit({"steps": [asdict(s) for s in steps], "blocking": sum(1 for s in steps if s.blocking)})
    else:
        click.echo(mig.render(steps, api.configuration.host))
    sys.exit(1 if any(s.blocking for s in steps) else 0)


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli(prog_name="modelcache")


if __name__ == "__main__":
    main()
