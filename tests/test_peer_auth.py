"""Who may read from the peer server, and what an unauthenticated client can make it spend
(agent/peering.py's TokenReviewer; the real TokenReview on the API server is in
tests/test_agent_peers.py): junk tokens cost no review, reviews are rate-limited, verdicts are an
LRU, and an empty ``status.audiences`` is not the peer audience (PEER-REVIEW F6, F10)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest

import agent.peering as peering
from agent.peering import AUDIENCE, TokenReviewer, plausible
from modelcache.peers.server import OK, THROTTLED, UNAUTHENTICATED

AGENT = "system:serviceaccount:modelcache-system:modelcache-agent"


def jwt(aud: Any = AUDIENCE, exp: float | None = None, sub: str = "x") -> str:
    def part(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part({'aud': aud, 'exp': exp or time.time() + 600, 'sub': sub})}.c2ln"


class FakeKube:
    api_client = None


def reviewer(answers: dict[str, tuple[bool, str]], **kw: Any) -> tuple[TokenReviewer, list[str]]:
    r = TokenReviewer(FakeKube(), **kw)  # type: ignore[arg-type]
    asked: list[str] = []

    def review(token: str) -> tuple[bool, str]:
        asked.append(token)
        return answers.get(token, (False, ""))

    r.review = review  # type: ignore[method-assign]
    r.allowed = AGENT
    return r, asked


def test_a_token_that_cannot_be_ours_costs_no_review():
    assert plausible(jwt()) and plausible(jwt(aud=["api", AUDIENCE]))
    assert not plausible(jwt(aud="https://kubernetes.default.svc"))  # the API audience
    assert not plausible(jwt(exp=time.time() - 1))  # expired
    for junk in ("", "x", "a.b", "a.b.c", "a..c", jwt()[:-5] + "!!!!!", "e30.e30.e30"):
        assert not plausible(junk), junk
    r, asked = reviewer({})
    assert [r.authorize(f"junk-{i}") for i in range(1000)] == [UNAUTHENTICATED] * 1000
    assert asked == []


def test_reviews_are_rate_limited_and_the_agents_verdicts_survive_junk(monkeypatch):
    # F6: one client made 159 TokenReviews a second, and 4096 junk tokens evicted the agents'
    # verdicts (the cache was FIFO).
    monkeypatch.setattr(peering, "REVIEW_CACHE", 16)
    good = jwt(sub="agent")
    r, asked = reviewer({good: (True, AGENT)}, rate=5.0, at_once=2)
    assert r.authorize(good) == OK
    verdicts = []
    for i in range(100):  # plausible junk, as fast as it comes
        verdicts.append(r.authorize(jwt(sub=f"junk-{i}")))
        assert r.authorize(good) == OK  # a hit keeps it the newest: never evicted
    assert len(asked) <= 1 + 2 * 5 + 2  # the burst, and what the rate refilled meanwhile
    assert verdicts.count(THROTTLED) >= 80 and set(verdicts) == {UNAUTHENTICATED, THROTTLED}
    assert asked.count(good) == 1


def test_an_empty_audience_list_is_not_the_peer_audience(monkeypatch):
    # F10: TokenReview's status.audiences empty means "the API server's audience", not ours.
    r = TokenReviewer(FakeKube())  # type: ignore[arg-type]

    class Resp:
        def __init__(self, status: dict[str, Any]) -> None:
            self.data = json.dumps({"status": status}).encode()

    answers = {"empty": {"authenticated": True, "user": {"username": AGENT}, "audiences": []},
               "ours": {"authenticated": True, "user": {"username": AGENT}, "audiences": [AUDIENCE]}}
    monkeypatch.setattr(r, "_api", type("Api", (), {
        "create_token_review": staticmethod(lambda body, **kw: Resp(answers[body["spec"]["token"]]))})())
    assert r.review("empty") == (False, AGENT)
    assert r.review("ours") == (True, AGENT)


@pytest.mark.parametrize("status", [500, "down"])
def test_an_api_server_that_cannot_answer_means_ask_again_soon(status):
    r, _ = reviewer({})

    def broken(token: str) -> tuple[bool, str]:
        raise RuntimeError(status)

    r.review = broken  # type: ignore[method-assign]
    assert r.authorize(jwt()) == THROTTLED  # 503 to the peer, not a refusal it would back off from


class NoModels:
    """A catalog that holds nothing: an authorized request gets 404, a refused one 401/403/503."""

    def have(self, *args: Any) -> None:
        return None

    def range(self, *args: Any) -> None:
        return None


def test_one_client_with_junk_tokens_costs_the_api_server_a_bounded_number_of_reviews(tmp_path):
    # F6 (a), as the review ran it: the real PeerServer and TokenReviewer.authorize, review() a
    # counter with a 5 ms "API", one client on 8 connections for 5 s with a fresh well-formed token
    # each request: 796 requests made 796 TokenReviews (159/s), all charged to the agents.
    import http.client
    import ssl
    import threading

    from coordinator.certs import generate_self_signed
    from modelcache.peers.server import REFUSALS, PeerServer, server_context
    from modelcache.sources.uri import storage_key

    good = jwt(sub="agent")
    r, asked = reviewer({good: (True, AGENT)})
    answer = r.review

    def slow_review(token: str) -> tuple[bool, str]:
        time.sleep(0.005)
        return answer(token)

    r.review = slow_review  # type: ignore[method-assign]
    cert, key = generate_self_signed(tmp_path, ["127.0.0.1"])
    server = PeerServer("127.0.0.1", 0, server_context(str(cert), str(key)), NoModels(), r.authorize).start()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE

    def get(token: str, source: str = "127.0.0.1") -> int:
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=ctx, timeout=10,
                                           source_address=(source, 0))
        try:
            conn.request("GET", f"/v1/models/{storage_key('file:///m')}/{'0' * 32}/have",
                         headers={"Authorization": f"Bearer {token}"})
            return conn.getresponse().status
        finally:
            conn.close()

    codes: list[int] = []
    stop = time.monotonic() + 5

    def flood(worker: int) -> None:
        i = 0
        while time.monotonic() < stop:
            codes.append(get(jwt(sub=f"junk-{worker}-{i}")))
            i += 1

    try:
        threads = [threading.Thread(target=flood, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        junk_reviews = len(asked)
        # The address is refused without a check after REFUSALS refusals in a minute; what came
        # before was also bounded by the review rate (503: ask again).
        assert len(codes) >= 100 and junk_reviews <= REFUSALS + 4, (len(codes), junk_reviews)
        assert set(codes) <= {401, 503}  # 503 while reviews were at their rate: "ask again"
        # An agent from another address is still served (its review may wait for the rate: 503, then
        # asked again as a client does after Retry-After).
        deadline = time.monotonic() + 5
        status = get(good, "127.0.0.2")
        while status == 503 and time.monotonic() < deadline:
            time.sleep(1)
            status = get(good, "127.0.0.2")
        assert status == 404  # authorized: the catalog holds nothing
        assert asked.count(good) == 1
        print(f"\n{len(codes)} junk requests in 5 s: {junk_reviews} TokenReviews, {codes.count(503)} answered 503")
    finally:
        server.stop()
