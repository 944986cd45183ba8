"""What the ``modelcache`` commands share: their options (``--root``, ``--log-level``,
``--assume-unused``, sizes), the one-line ``error:`` exit, JSON output, and how a command opens
the store and names a model (a storage key or the URI it was pulled from).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from modelcache.engine.resources import chunk_size_problem
from modelcache.runtime.logs import setup_cli_logging
from modelcache.runtime.redact import redact_uri, scrub_urls
from modelcache.runtime.sizes import parse_size
from modelcache.runtime.startup import StartupError
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore

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


def check_chunk_size(_ctx: click.Context, _param: click.Parameter, value: int) -> int:
    problem = chunk_size_problem(value)
    if problem:
        raise click.BadParameter(problem)
    return value


def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {scrub_urls(message)}", err=True)
    sys.exit(code)


def emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=1, default=str))


def root_option(f: Any) -> Any:
    return click.option(
        "--root", type=click.Path(file_okay=False, path_type=Path), envvar="MODELCACHE_ROOT", show_envvar=True,
        default=DEFAULT_ROOT, show_default=True, help="Node store root.",
    )(f)


def assume_unused_option(f: Any) -> Any:
    return click.option(
        "--assume-unused", is_flag=True,
        help="Where the CLI cannot see every mount on the node (not root, or a container without "
        "hostPID), assume no pod mounts the models it replaces or deletes.",
    )(f)


def mount_guard_for(assume_unused: bool) -> Any:
    """No model folder that a pod on this node mounts is replaced or deleted (modelcache.store.mountusers)."""
    from modelcache.store.mountusers import mount_guard

    return mount_guard(assume_unused)


def open_store(root: Path, assume_unused: bool | None = None) -> NodeStore:
    """The store of a command that reads or deletes: its root must be there (a typo in --root
    must not answer "nothing found" or create folders). ``assume_unused`` (commands that delete):
    the mount guard."""
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise StartupError(f"--root {root} {what}: no model store there; point --root (or MODELCACHE_ROOT) "
                           "at the store's root")
    return NodeStore.at(root, guard=None if assume_unused is None else mount_guard_for(assume_unused))


def key_of(arg: str) -> str:
    """Commands take a storage key or the URI it was pulled from."""
    return arg if re.fullmatch(r"[0-9a-f]{16}", arg) else storage_key(arg)


def not_stored(arg: str, root: Path) -> None:
    click.echo(f"error: {scrub_urls(redact_uri(arg))}: not in the store at {root} (nothing was pulled from this "
               "exact URI or key; `modelcache ls` lists what is there)", err=True)


def folder_name(root: Path, arg: str) -> str | None:
    """``arg`` when it names a folder under ``<root>/models`` exactly (one not made by modelcache,
    which only ``rm`` of its name deletes), else None."""
    if "/" in arg or arg.startswith(".") or not arg:
        return None
    return arg if (root / "models" / arg).is_dir() else None


LEVELS = click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False)


def set_log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # Given after the sub-command (`modelcache pull --log-level info`) it wins over the group's.
    if value is not None and ctx.get_parameter_source(param.name or "") == ParameterSource.COMMANDLINE:
        setup_cli_logging(value)


def log_level_option(f: Any) -> Any:
    return click.option("--log-level", type=LEVELS, default=None, expose_value=False, callback=set_log_level,
                        help="Log level (as `modelcache --log-level`): info shows what each step does.")(f)
