"""Test tiers: what a test needs besides `make install`, read from the fixtures it requests.

- ``unit``: nothing but the venv (``make check``). In-process fakes of ours (the test Hubs, the
  WebHDFS stand-in, token servers) count as code, not servers.
- ``servers``: a server or tool that a `tests/setup.d/` script installs (nginx, moto, the GCS
  emulator, Azurite, the registry, MiniDFS, the KDC, podman and the image, SeaweedFS).
- ``cluster``: the Kubernetes control plane (and KServe's controllers) built from Go modules.

Orthogonal to the tier, ``go``: the test needs something built from Go modules (the control plane,
KServe, SeaweedFS), which `make test-servers` does not build.

A fixture module under tests/fixtures/ says what its fixtures need once, with module constants
``TIER`` (and ``GO_BUILD = True``), or a single fixture says it with ``@tiers.needs(...)``; a
test's tier is the highest among the fixtures in its closure (whatever it requests, directly or
through other fixtures), so a new test is tiered by the fixtures it uses, with no mark to remember.
An explicit ``servers``/``cluster`` mark (e.g. on a ``pytest.param`` of a fixture that picks its
server at run time) raises it.

What the fixtures cannot show is checked when the test runs (``reach``, and the fixtures a test
asked for with ``request.getfixturevalue``): a test that reaches a higher tier than it was given
fails with the fix, so a wrong tier never lands silently.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

UNIT, SERVERS, CLUSTER = "unit", "servers", "cluster"
TIERS = (UNIT, SERVERS, CLUSTER)
GO = "go"
MARKERS = {
    UNIT: "needs nothing but the venv (set automatically from the fixtures; `make check`)",
    SERVERS: "needs a server or tool from tests/setup.d (set automatically from the fixtures)",
    CLUSTER: "needs the Kubernetes control plane built from Go (set automatically from the fixtures)",
    GO: "needs a build from Go modules: the control plane, KServe or SeaweedFS (set automatically)",
}


@dataclass(frozen=True)
class Need:
    tier: str
    go: bool
    why: str  # the fixture (or mark) that decided it, for messages

    def rank(self) -> int:
        return TIERS.index(self.tier)


F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "_modelcache_test_tier"
NONE = Need(UNIT, False, "no fixture that needs a server")
KEY = pytest.StashKey[Need]()
_current: pytest.Item | None = None


def needs(tier: str, go: bool = False) -> Callable[[F], F]:
    """The tier of one fixture whose module has no ``TIER`` of its own (a module of in-process
    fakes, a test module): put it under ``@pytest.fixture``."""
    if tier not in TIERS:
        raise ValueError(f"tier {tier!r}: use one of {', '.join(TIERS)}")

    def decorate(fn: F) -> F:
        fn.__dict__[_ATTR] = (tier, go)
        return fn

    return decorate


def fixture_need(func: object, fixture: str) -> Need | None:
    """What a fixture function needs: its own ``needs``, else its module's ``TIER``."""
    module = getattr(func, "__module__", "") or ""
    own = getattr(func, _ATTR, None)
    if own is not None:
        return Need(own[0], own[1], f"fixture '{fixture}' ({module})")
    mod = sys.modules.get(module)
    tier = getattr(mod, "TIER", None)
    if tier is None:
        return None
    if tier not in TIERS:
        raise pytest.UsageError(f"{module}.TIER is {tier!r}: use one of {', '.join(TIERS)}")
    return Need(tier, bool(getattr(mod, "GO_BUILD", False)), f"fixture '{fixture}' ({module})")


def highest(needs: Iterable[Need]) -> Need:
    best = NONE
    go = False
    for need in needs:
        go = go or need.go
        if need.rank() > best.rank():
            best = need
    return Need(best.tier, go, best.why)


def fixture_needs(item: pytest.Item) -> list[Need]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a Python test function (a doctest, a plugin's item)
        return []
    needs = []
    for name, defs in info.name2fixturedefs.items():
        for fixturedef in defs:
            need = fixture_need(fixturedef.func, name)
            if need is not None:
                needs.append(need)
    return needs


def mark_needs(item: pytest.Item) -> list[Need]:
    needs = []
    for tier in (SERVERS, CLUSTER):
        if item.get_closest_marker(tier) is not None:
            needs.append(Need(tier, tier == CLUSTER or item.get_closest_marker(GO) is not None, f"mark '{tier}'"))
    return needs


def classify(item: pytest.Item) -> Need:
    need = highest([*fixture_needs(item), *mark_needs(item)])
    if need.tier == CLUSTER:
        need = Need(CLUSTER, True, need.why)
    return need


def group_of(item: pytest.Item, need: Need) -> str | None:
    """The xdist group (``--dist loadgroup``) of a test: every cluster test on one worker, since
    they share one control plane that each test resets to its baseline (fixed names, so two at once
    would collide); tests of a heavy session server (a fixture module's ``XDIST_GROUP``: MiniDFS, a
    JVM of ~1 GB that starts in ~20 s) on one worker, so it is started once. Other session
    servers (moto, Azurite, the registry, ...) start in a second or two, each worker its own."""
    if need.tier == CLUSTER:
        return CLUSTER
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for fixturedef in defs:
            group = getattr(sys.modules.get(getattr(fixturedef.func, "__module__", "")), "XDIST_GROUP", None)
            if group:
                return str(group)
    return None


def mark(items: list[pytest.Item]) -> None:
    for item in items:
        need = classify(item)
        item.stash[KEY] = need
        if item.get_closest_marker(need.tier) is None:
            item.add_marker(need.tier)
        if need.go and item.get_closest_marker(GO) is None:
            item.add_marker(GO)
        group = group_of(item, need)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


def reach(tier: str, what: str, go: bool = False) -> None:
    """Called where a test reaches ``what`` (of ``tier``) by a path fixtures do not show: fails
    the running test if it was tiered lower. Outside a test (a benchmark, `make demo`): nothing."""
    item = _current
    if item is None or KEY not in item.stash:
        return
    given = item.stash[KEY]
    if TIERS.index(tier) > given.rank() or (go and not given.go):
        needed = f"'{tier}'" + (" and a Go build" if go else "")
        pytest.fail(
            f"{item.nodeid} reached {what}, which needs {needed}, but was tiered '{given.tier}' "
            f"({given.why}): request the fixture that provides it (tests/fixtures/), so tests/tiers.py "
            "runs it in the right lane",
            pytrace=False,
        )


def check_requested(item: pytest.Item, names: Iterable[str]) -> None:
    """The fixtures a test ended up with, ``getfixturevalue`` included, against its tier."""
    manager = item.session._fixturemanager
    for name in names:
        for fixturedef in manager.getfixturedefs(name, item) or ():
            need = fixture_need(fixturedef.func, name)
            if need is not None:
                reach(need.tier, need.why, need.go)


# ---- the plugin (listed in tests/conftest.py) --------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects and before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark(items)
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        for item in items:
            group_nodeid(item)


def group_nodeid(item: pytest.Item) -> None:
    """Put an item's xdist group into its node id (``<id>@<group>``), which is all the
    controller's loadgroup scheduler sees. xdist does this itself by setting ``Item._nodeid``,
    which pytest 9.2 no longer reads (the id is ``Item._id``), so with pytest 9.2 and xdist 3.8
    no group is kept together; this sets it where pytest reads it."""
    groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                     for m in item.iter_markers("xdist_group")})
    if not groups or "@" in item.nodeid.rsplit("]", 1)[-1]:
        return
    nodeid = f"{item.nodeid}@{'_'.join(groups)}"
    if hasattr(item, "_id"):
        from _pytest.nodeid import coerce_node_id  # pytest >= 9.2

        item._id = coerce_node_id(nodeid)
    else:
        item._nodeid = nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    global _current
    before, _current = _current, item
    try:
        return (yield)
    finally:
        _current = before


@pytest.fixture(autouse=True)
def _tier_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: the fixtures it asked for at run time (``getfixturevalue``) fit its tier."""
    yield
    check_requested(request.node, request.fixturenames)
