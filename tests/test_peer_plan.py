"""The swarm's decisions (modelcache/peers/plan.py) on a clock of the test's own, without a socket
or a thread: what a swarm simulator drives. Whose word counts, who reads the origin, how long a
piece waits, and what a misbehaving peer costs."""

from __future__ import annotations

from modelcache.peers.plan import STARVING_PAUSE, PeerState, Plan, Step
from modelcache.peers.settings import SwarmSettings

H1, H2 = "a" * 64, "b" * 64


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def plan(clock: Clock, *peers: str, checked: bool = False, **settings: float) -> Plan:
    p = Plan(SwarmSettings(node="me", formation=0.0, **settings), "key", workers=4, clock=clock,  # type: ignore[arg-type]
             checked=frozenset({0}) if checked else frozenset(), files=1)
    for name in peers:
        state = PeerState(name)
        p.add(state)
        p.heard(state, True, [], [], complete=False)
    return p


def vouch(p: Plan, name: str, value: str, origin: bool = True, complete: bool = True) -> None:
    p.heard(p.peers[name], False, [(0, 0, value, origin)], [], complete=complete)


def test_a_file_without_checksum_takes_a_piece_only_on_two_agreeing_witnesses():
    clock = Clock()
    p = plan(clock, "x", "y", "z")
    vouch(p, "x", H1)
    assert p.expected("x", 0, 0) is None and p.usable_holders(0, 0) == []  # one node's word
    vouch(p, "y", H1, origin=False)
    assert p.expected("y", 0, 0) is None  # a relay is no witness
    vouch(p, "z", H1)
    assert p.expected("y", 0, 0) == H1 and {h.name for h in p.usable_holders(0, 0)} == {"x", "y", "z"}
    vouch(p, "y", H2)  # now a witness that disagrees: nobody's word counts, the origin decides
    assert p.usable_holders(0, 0) == [] and "me" in p.owners(0, 0)
    assert p.settle(0, 0, H1) == {"y": H2}


def test_a_checked_file_takes_the_holders_word_the_file_check_having_the_last():
    clock = Clock()
    p = plan(clock, "x", checked=True)
    vouch(p, "x", H1, origin=False)
    assert p.expected("x", 0, 0) == H1
    p.took("x", 0, 0, H1)
    assert p.distrusted(0, lambda n: False) is None
    p.exclude("x")
    assert p.distrusted(0, lambda n: False) == "piece 0 came on the word of x, found lying since"


def test_unchecked_pieces_are_owned_by_two_members_and_a_witness_counts_as_one():
    clock = Clock()
    p = plan(clock, "x", "y", "z")
    owners = p.owners(0, 0)
    assert len(owners) == 2 and len(set(owners)) == 2
    first = owners[0]
    vouch(p, first, H1, complete=False)
    assert len(p.owners(0, 0)) == 1 and first not in p.owners(0, 0)
    assert plan(clock, "x", checked=True).owners(0, 0) in (["me"], ["x"])


def test_a_piece_waits_for_its_owner_at_most_half_the_stall_timeout_and_the_owner_then_owns_nothing():
    clock = Clock()
    p = plan(clock, "x", witnesses=1, wait=20.0, stall_timeout=8.0)
    p.peers["x"].fetching = {(0, p_) for p_ in range(100)}  # claims every piece, delivers none
    started = clock()
    assert p.step(0, 0, started).holders == () and not p.step(0, 0, started).origin
    clock.now += 3.9
    assert not p.step(0, 0, started).origin
    clock.now += 0.1  # 4 s: half the stall timeout (not the 20 s of --peer-wait)
    step = p.step(0, 0, started)
    assert step.origin and step.late and step.missed == "x"
    p.missed("x")
    assert p.owners(0, 1) == ["me"] and p.members() == ["me"]


def test_an_owner_reading_its_share_from_the_origin_is_waited_for_the_budget_one_reading_nothing_half():
    def owned_by_x() -> tuple[Plan, Clock, int]:
        clock = Clock()
        p = plan(clock, "x", "y", witnesses=1, wait=20.0, stall_timeout=8.0)  # a budget of 4 s
        return p, clock, next(n for n in range(200) if p.owners(0, n) == ["x"])

    # x reads another piece of its share from the origin: half the budget is not enough to give up.
    p, clock, piece = owned_by_x()
    p.peers["x"].fetching = {(0, piece + 1)}
    started = clock()
    assert p.step(0, piece, started) == Step()
    clock.now += 2.0
    assert p.step(0, piece, started) == Step() and not p.peers["x"].health.missed
    clock.now += 2.0  # the whole budget: read from the origin, and x owns nothing more
    step = p.step(0, piece, started)
    assert step.origin and step.late and step.missed == "x"
    # x reads nothing from the origin: half the budget, and its blocks go to the next member.
    p, clock, piece = owned_by_x()
    started = clock()
    assert p.step(0, piece, started) == Step()
    clock.now += 2.0
    step = p.step(0, piece, started)
    assert step.missed == "x" and not step.late and "x" not in p.owners(0, piece)


def test_an_owner_seen_reading_the_piece_is_waited_a_budget_from_then_within_the_stall_bound():
    def owned_by_x() -> tuple[Plan, Clock, int]:
        clock = Clock()
        p = plan(clock, "x", "y", witnesses=1, wait=20.0, stall_timeout=10.0)  # a budget of 5 s, a bound of 8 s
        return p, clock, next(n for n in range(200) if p.owners(0, n) == ["x"])

    # x is seen reading this very piece 2 s in: a budget from then (7 s), not from the start (5 s).
    p, clock, piece = owned_by_x()
    started = clock()
    assert p.step(0, piece, started) == Step()
    clock.now += 2.0
    p.heard(p.peers["x"], False, [], [(0, piece)], complete=False)
    for at in (5.0, 6.9):
        clock.now = started + at
        assert p.step(0, piece, started) == Step(), at
    clock.now = started + 7.0
    step = p.step(0, piece, started)
    assert step.origin and step.late and step.missed == "x"
    # Seen reading it late (4.9 s in, reading another piece of its share before): the wait still
    # ends at 0.8 of the stall timeout after the piece was first asked for, not at 9.9 s.
    p, clock, piece = owned_by_x()
    p.heard(p.peers["x"], False, [], [(0, piece + 1)], complete=False)
    started = clock()
    assert p.step(0, piece, started) == Step()
    clock.now += 4.9
    p.heard(p.peers["x"], False, [], [(0, piece)], complete=False)
    clock.now = started + 7.9
    assert p.step(0, piece, started) == Step()
    clock.now = started + 8.0
    step = p.step(0, piece, started)
    assert step.origin and step.late and step.missed == "x"


def test_a_busy_holder_is_asked_again_after_retry_after_and_left_alone_once_a_budget_ran_out():
    clock = Clock()
    p = plan(clock, "x", checked=True, stall_timeout=10.0)
    vouch(p, "x", H1)
    started = clock()
    p.busy("x", 1.0)
    assert p.usable_holders(0, 0) == [] and not p.step(0, 0, started).origin  # its witness still counts
    clock.now += 1.0
    assert [h.name for h in p.usable_holders(0, 0)] == ["x"]
    p.busy("x", 1.0)
    clock.now += 5.0
    assert p.step(0, 0, started).late
    assert p.peers["x"].health.down_until == clock() + STARVING_PAUSE
    assert p.owners(0, 1) == ["me"]  # down: its word is not waited for


def test_a_piece_held_by_a_busy_peer_that_served_us_waits_to_the_stall_bound_not_the_budget():
    # bench/swarm_sim.py in bench/fleet.py's 16-node world: 41 of the 42 pieces read from the
    # origin past their budget were held, each by peers that all answered "busy".
    clock = Clock()
    p = plan(clock, "x", checked=True, stall_timeout=10.0)  # a budget of 5 s, a bound of 8 s
    vouch(p, "x", H1)
    p.delivered("x")  # it served us a piece before
    started = clock()
    for at in (0.0, 5.0, 7.9):  # busy all along, Retry-After 1 s
        clock.now = started + at
        p.busy("x", 1.0)
        assert p.step(0, 0, started) == Step(), at
    clock.now = started + 8.0
    step = p.step(0, 0, started)
    assert step.origin and step.late and step.held
    assert p.peers["x"].health.down_until == clock() + STARVING_PAUSE  # left alone after, as before
    # A holder that missed a read's deadline is not waited for at all (the piece is ours to read).
    p = plan(clock, "x", checked=True, stall_timeout=10.0)
    vouch(p, "x", H1)
    p.delivered("x")
    p.slow("x")
    step = p.step(0, 0, clock())
    assert step.origin and not step.held


def test_a_slow_peer_has_two_strikes_and_failures_pause_it_longer_each_time():
    clock = Clock()
    p = plan(clock, "x", checked=True)
    vouch(p, "x", H1)
    p.slow("x")
    clock.now += 31
    assert [h.name for h in p.usable_holders(0, 0)] == ["x"]
    p.slow("x")
    clock.now += 1000
    assert p.usable_holders(0, 0) == []
    q = plan(clock, "y", checked=True)
    vouch(q, "y", H1)
    pauses = []
    for _ in range(4):
        q.failed("y")
        pauses.append(q.peers["y"].health.down_until - clock())
        q.heard(q.peers["y"], False, [], [], complete=True)
    assert pauses == [1.0, 2.0, 4.0, 8.0]
    clock.now += 10
    q.delivered("y")
    q.failed("y")
    assert q.peers["y"].health.down_until - clock() == 1.0


def test_a_vouch_heard_after_we_read_the_piece_ourselves_is_checked_too():
    clock = Clock()
    p = plan(clock, "x")
    assert p.settle(0, 0, H1) == {}
    why = p.heard(p.peers["x"], False, [(0, 0, H2, True)], [], complete=True)
    assert why is not None and f"sha-256 {H1} at the origin, x said {H2}" in why


def test_a_relay_of_a_witnesss_lie_is_not_blamed_the_witness_is():
    # A checked file: "liar" says it read the piece from the origin (a forged hash); "relay", an
    # honest node, took it on that word and passes it on before its own file check fails. When the
    # origin settles the piece, only the witness is to be excluded: excluding the relay too made
    # every honest node that served a liar's piece excluded (and published) by all it served.
    clock = Clock()
    p = plan(clock, "liar", "relay", "other", checked=True)
    vouch(p, "liar", H2)
    vouch(p, "relay", H2, origin=False)
    p.took("relay", 0, 0, H2)  # we took its bytes: they matched its (relayed) word
    p.exclude("liar")  # found out already (another piece, another download): its word is forgotten
    assert p.settle(0, 0, H1) == {"liar": H2}
    # A relay's vouch heard after the origin settled the piece: the same rule.
    assert p.heard(p.peers["relay"], False, [(0, 0, H2, False)], [], complete=True) is None
    # A hash no witness ever vouched for: the relay made it up, and is excluded.
    q = plan(clock, "relay", checked=True)
    vouch(q, "relay", H2, origin=False)
    q.took("relay", 0, 0, H2)
    assert q.settle(0, 0, H1) == {"relay": H2}
    why = q.heard(q.peers["relay"], False, [(0, 1, H2, False)], [], complete=True)
    assert why is None and q.settle(0, 1, H1) == {"relay": H2}


def test_a_witness_changing_its_word_at_every_poll_grows_nothing_and_is_still_blamed():
    # The claims are kept for blame (a relay of a lie is blamed on the witness that told it): a
    # peer that vouched a new hash for each piece at every poll would grow them without a bound.
    clock = Clock()
    p = plan(clock, "liar")
    for i in range(1000):
        vouch(p, "liar", f"{i:064x}")
    assert sum(len(names) for names in p.claims[(0, 0)].values()) == 2
    assert "liar" in p.settle(0, 0, H1)
