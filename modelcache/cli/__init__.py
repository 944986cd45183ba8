"""The ``modelcache`` command, the top floor of the core: ``commands`` (the click group and its
sub-commands: pull, ls, verify, rm, gc, migrate, status), ``options`` (what the commands share:
options, the one-line ``error:`` exit, JSON output, opening the store) and ``display`` (progress
bars on a terminal, a plain line every few seconds in logs).

``main`` is named here because the console script (``modelcache = "modelcache.cli:main"`` in
pyproject.toml) and the script every existing install generated from it import it from this
package.
"""

from modelcache.cli.commands import main

__all__ = ["main"]
