"""Start-up failures of the long-running processes, each as one line naming the flag that fixes it.

``modelcache-agent`` and ``modelcache-coordinator`` run in pods whose logs are read by someone
who did not write the flags: a port already taken, an unreadable kubeconfig, a read-only root or
missing certificate files must say so in one line and point at the flag, not end in a
traceback. ``run_command`` runs a click command that way: a bad flag value is click's usage
error on one line (exit 2), a ``StartupError`` the same (exit 2).
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import uuid
from pathlib import Path

import click

from modelcache.errors import ModelcacheError
from modelcache.runtime.redact import scrub_urls

USAGE_EXIT = 2
#: A command stopped by Ctrl-C: 128 + SIGINT, as shells report it.
INTERRUPTED_EXIT = 130


class StartupError(ModelcacheError):
    """The process cannot start as configured; the message names the flag that fixes it.

    ``problems``: several independent faults (each field of an invalid spec file), printed one
    ``error:`` line each before the message."""

    reason = "StartupError"

    def __init__(self, message: str, problems: tuple[str, ...] | list[str] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


def env_for_every_flag(command: click.Command, prefix: str) -> click.Command:
    """Give every option of ``command`` an environment variable (``prefix`` + its flag's name,
    unless it has one) and show it in ``--help``: a pod's flags are set in its env as often as in
    its args."""
    for param in command.params:
        if isinstance(param, click.Option) and param.opts:
            if not param.envvar:
                param.envvar = prefix + param.opts[0].lstrip("-").replace("-", "_").upper()
            param.show_envvar = True
    return command


def run_command(command: click.Command, prog_name: str) -> None:
    """Run ``command``; usage and start-up errors become ``error: ...`` on one line, exit 2."""
    try:
        code = command.main(prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort as exc:
        if isinstance(exc.__context__ or exc.__cause__, KeyboardInterrupt):
            click.echo("error: interrupted", err=True)
            sys.exit(INTERRUPTED_EXIT)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        sys.exit(INTERRUPTED_EXIT)
    except click.ClickException as exc:
        # Not click's "Usage: ... Try --help" block: one line a pod's log shows whole.
        # The sub-command's own help where the error is about it (`modelcache gc --help`).
        where = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx is not None else prog_name
        hint = f" (see {where} --help)" if isinstance(exc, click.UsageError) else ""
        click.echo(f"error: {' '.join(exc.format_message().split())}{hint}", err=True)
        sys.exit(exc.exit_code)
    except StartupError as exc:
        for line in (*exc.problems, str(exc)):
            click.echo(f"error: {scrub_urls(' '.join(line.split()))}", err=True)
        sys.exit(USAGE_EXIT)
    sys.exit(code if isinstance(code, int) else 0)


def listen_error(exc: OSError, host: str, port: int, port_flag: str, host_flag: str) -> StartupError:
    """Why a server could not bind ``host:port``, and which flag changes it."""
    where = f"cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return StartupError(f"{where}: the port is already in use; choose another with {port_flag} "
                            "(or stop the process that holds it)")
    if exc.errno == errno.EACCES:
        return StartupError(f"{where}: permission denied (ports below 1024 need privileges); "
                            f"choose a port above 1024 with {port_flag}")
    if isinstance(exc, socket.gaierror) or exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
        return StartupError(f"{where}: {exc.strerror or exc}; set {host_flag} to an address of this machine "
                            "(0.0.0.0 for all)")
    return StartupError(f"{where}: {exc.strerror or exc}; check {host_flag} and {port_flag}")


def check_writable_dir(path: Path, flag: str) -> None:
    """Fail now, in one line, if ``path`` cannot be written (a read-only mount, say), instead of
    failing every download later. Creates the folder if it is missing."""
    probe = path / f".modelcache-probe-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if exc.errno == errno.EROFS:
            why = "the file system is read-only; mount it read-write or"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            why = "permission denied; make it writable for this user or"
        elif exc.errno == errno.ENOSPC:
            why = "no space left on the device; free space or"
        elif exc.errno in (errno.ENOTDIR, errno.EEXIST):
            why = "it is not a directory;"
        else:
            why = f"{exc.strerror or exc};"
        raise StartupError(f"{flag} {path}: cannot write there: {why} point {flag} at a writable directory") from None
