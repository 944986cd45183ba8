"""The test tiers (tests/tiers.py): each test is marked from the fixtures it requests, `-m unit`
selects what needs no server, and a test that reaches a server its fixtures do not show fails."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = '''
import pytest
from tests import tiers

TIER = tiers.SERVERS  # this module's fixtures start servers, unless a fixture says otherwise

@pytest.fixture(scope="session")
def moto():
    return "s3"

@pytest.fixture
def bucket(moto):  # a server only through another fixture
    return moto + "://b"

@pytest.fixture
@tiers.needs(tiers.CLUSTER)
def control_plane():
    return "cp"

@pytest.fixture
@tiers.needs(tiers.UNIT)
def fake_hub():  # in-process: code, not a server
    return "hub"

@pytest.fixture(params=[pytest.param("moto", marks=pytest.mark.servers)])
def picked(request):  # picks its server at run time: the param says what it needs
    return request.getfixturevalue(request.param)
'''

TESTS = '''
from tests import tiers

def test_pure():
    pass

def test_hub(fake_hub, tmp_path):
    pass

def test_bucket(bucket):
    pass

def test_cluster(control_plane, bucket):
    pass

def test_picked(picked):
    pass

def test_sneaks_a_server_in(request):
    request.getfixturevalue("moto")

def test_starts_a_control_plane_by_hand():
    tiers.reach(tiers.CLUSTER, "the control plane binaries", go=True)
'''


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_x=TESTS)
    return pytester


def selected(result: pytest.RunResult) -> set[str]:
    return {line.split("::")[1].split(" ")[0] for line in result.outlines if line.startswith("test_x.py::")}


def test_each_test_is_marked_from_the_fixtures_it_requests(project: pytest.Pytester) -> None:
    def only(expr: str) -> set[str]:
        return selected(project.runpytest("-p", "tests.tiers", "--collect-only", "-q", "-m", expr))

    assert only("unit") == {"test_pure", "test_hub", "test_sneaks_a_server_in", "test_starts_a_control_plane_by_hand"}
    assert only("servers") == {"test_bucket", "test_picked[moto]"}
    assert only("cluster") == {"test_cluster"}  # the highest of its fixtures
    assert only("go") == {"test_cluster"}
    assert only("not go") == only("unit") | only("servers")


def test_a_test_that_reaches_more_than_its_fixtures_show_fails_with_the_fix(project: pytest.Pytester) -> None:
    # `-rN`: no short summary, which repeats each message in full under CI=true (pytest truncates
    # it to the terminal's width elsewhere), so each message is counted once wherever this runs
    result = project.runpytest("-p", "tests.tiers", "-q", "-p", "no:cacheprovider", "-rN")
    # test_sneaks_a_server_in passes its call and errs at teardown, where what it asked for is known.
    result.assert_outcomes(passed=6, failed=1, errors=1)
    out = result.stdout.str()
    assert ("test_x.py::test_sneaks_a_server_in reached fixture 'moto' (conftest), which needs 'servers', but "
            "was tiered 'unit' (no fixture that needs a server)") in out
    assert ("test_x.py::test_starts_a_control_plane_by_hand reached the control plane binaries, which needs "
            "'cluster' and a Go build, but was tiered 'unit'") in out
    assert out.count("request the fixture that provides it") == 2


def test_cluster_tests_share_one_xdist_worker(project: pytest.Pytester) -> None:
    """Under ``--dist loadgroup`` every cluster test runs on one worker (one control plane, reset
    after each test, cannot serve two tests at once); the others go wherever there is room."""
    # `-p xdist`: loaded by name, so the inner session has `-n` also where plugins are not
    # autoloaded (PYTEST_DISABLE_PLUGIN_AUTOLOAD=1)
    result = project.runpytest("-p", "tests.tiers", "-p", "no:cacheprovider", "-p", "xdist", "-n", "2", "--dist",
                               "loadgroup", "-v", "-k", "pure or hub or bucket or cluster")
    result.assert_outcomes(passed=4)
    workers = {}
    for line in result.outlines:
        if " PASSED " in line:
            worker, nodeid = line.split()[0], line.split()[-1]
            workers[nodeid] = worker
    assert set(workers) == {"test_x.py::test_pure", "test_x.py::test_hub", "test_x.py::test_bucket",
                            "test_x.py::test_cluster@cluster"}, result.outlines
