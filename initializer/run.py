"""Run SRC DEST pairs: independent destinations in parallel, pairs sharing one in order.

KServe runs pairs one after another (to avoid Hugging Face cache races). Pairs are
independent unless they write the same folder, so we group pairs whose DESTs are equal or
nested and give each group one worker: two pairs never race on one destination, while
different models still download at the same time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from initializer.dispatch import Context, run_pair
from initializer.report import PairOutcome, Reporter
from modelcache.errors import ModelcacheError
from modelcache.sources.uri import redact_uri


@dataclass(frozen=True)
class Pair:
    index: int
    src: str
    dest: str

    @property
    def dest_key(self) -> str:
        return os.path.realpath(os.path.abspath(self.dest))


def pairs_from_args(args: list[str]) -> list[Pair]:
    return [Pair(i // 2, args[i], args[i + 1]) for i in range(0, len(args), 2)]


def group_by_dest(pairs: list[Pair]) -> list[list[Pair]]:
    """Pairs whose destinations are equal or nested end up in one group, in argument order."""
    parent = list(range(len(pairs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    keys = [p.dest_key for p in pairs]
    for i in range(len(pairs)):
        for j in range(i):
            a, b = keys[i], keys[j]
            if a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/"):
                parent[find(i)] = find(j)
    groups: dict[int, list[Pair]] = {}
    for i, pair in enumerate(pairs):
        groups.setdefault(find(i), []).append(pair)
    return list(groups.values())


def describe_error(exc: BaseException) -> str:
    """One line for a failed pair. Our errors are written to be safe and helpful; anything
    else is an SDK or OS error, shown with its type (the scrubber still cleans it)."""
    if isinstance(exc, ModelcacheError):
        return str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return f"{type(exc).__name__}: {exc}"


@dataclass
class RunResult:
    ok: int
    failed: int
    outcomes: list[PairOutcome]


def run_pairs(
    pairs: list[Pair],
    ctx: Context,
    reporter: Reporter,
    max_parallel: int = 4,
    run_one: Callable[[str, Path, Context], PairOutcome] = run_pair,
) -> RunResult:
    outcomes: list[PairOutcome] = []
    failed = 0

    def run_group(group: list[Pair]) -> list[tuple[Pair, PairOutcome | BaseException]]:
        done: list[tuple[Pair, PairOutcome | BaseException]] = []
        for pair in group:
            start = time.monotonic()
            try:
                outcome = run_one(pair.src, Path(pair.dest), ctx)
            except Exception as exc:
                shown = redact_uri(pair.src)
                cause = describe_error(exc)
                # Most messages start with the URI; the line already names it once.
                for prefix in (f"{shown}: ", f"{pair.src}: "):
                    cause = cause.removeprefix(prefix)
                reporter.pair_failed(shown, pair.dest, cause)
                done.append((pair, exc))
                continue
            reporter.pair_done(redact_uri(pair.src), pair.dest, outcome, time.monotonic() - start)
            done.append((pair, outcome))
        return done

    groups = group_by_dest(pairs)
    workers = max(1, min(max_parallel, len(groups)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pair") as pool:
        for results in pool.map(run_group, groups):
            for _pair, res in results:
                if isinstance(res, BaseException):
                    failed += 1
                else:
                    outcomes.append(res)
    return RunResult(ok=len(outcomes), failed=failed, outcomes=outcomes)
