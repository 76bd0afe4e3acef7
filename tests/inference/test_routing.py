"""Placement (inference/routing.py) from engines' heartbeats, as the web tier reads them:
summaries built by engine/prefix_hash.py from the keys an engine caches."""

from __future__ import annotations

import collections
import hashlib
import itertools
import time

import pytest

from engine import protocol
from engine.prefix_hash import MAX_BITS, PrefixSummary, cache_scope, prompt_keys
from inference.routing import Router

SYSTEM = list(range(100, 100 + 1024))
_ids = itertools.count()  # a tenant's 1k-token system prompt
ADAPTER = "a" * 64


def _request(tenant: str = "t1", prompt: list[int] | None = None, **fields
             ) -> protocol.EngineRequest:
    prompt = prompt if prompt is not None else SYSTEM + [7, 8, 9]
    return protocol.EngineRequest(
        request_id=f"r{next(_ids)}", model="m", prompt_token_ids=prompt, tenant_id=tenant,
        sampling=protocol.SamplingSpec(max_tokens=4), cache_salt=f"salt-{tenant}", **fields)


def _beat(engine_id: str, *, cached: list[bytes] = (), adapters: list[str] = (),
          waiting: int = 0, running: int = 0, queued: int = 0, kv_usage: float = 0.1,
          seats: int = 96) -> protocol.EngineHeartbeat:
    now = time.time()
    return protocol.EngineHeartbeat(
        engine_id=engine_id, model="m", started_at=now, sent_at=now, waiting=waiting,
        running=running, queued=queued,
        placement={"stream": True, "prefix": PrefixSummary.of(list(cached), 16).to_dict(),
                   "adapters": list(adapters), "kv_usage": kv_usage, "seats": seats})


def _keys(request: protocol.EngineRequest) -> list[bytes]:
    scope = cache_scope(request.tenant_id, request.cache_salt, request.adapter_hash)
    return prompt_keys(request.prompt_token_ids, 16, scope)


def test_the_engine_holding_the_tenants_prefix_gets_the_request():
    request = _request()
    beats = [_beat("cold-1"), _beat("warm", cached=_keys(request)[:64]), _beat("cold-2")]
    for _ in range(20):
        placement = Router().place(request, beats)
        assert placement.engine_id == "warm" and placement.cached_tokens == 64 * 16
        assert placement.stream == protocol.engine_stream(request.model, "warm")


def test_a_burst_sharing_a_prefix_follows_its_first_request_before_any_heartbeat():
    router = Router()
    beats = [_beat("e1"), _beat("e2"), _beat("e3")]  # nothing cached anywhere yet
    first = router.place(_request(), beats)
    # The same tenant's next requests, with the same system prompt and other questions (a
    # few: each one sent there counts as load until the engine's next heartbeat):
    for question in range(3):
        follow = router.place(_request(prompt=SYSTEM + [question]), beats)
        assert (follow.engine_id, follow.cached_tokens) == (first.engine_id, 1024)
    # Another tenant's burst is placed on its own, by load.
    assert router.place(_request("t2"), beats).cached_tokens == 0


def test_another_tenants_cached_prefix_is_no_reason_to_go_there():
    theirs = _request("t0")
    beats = [_beat("theirs", cached=_keys(theirs)), _beat("idle")]
    placed = [Router().place(_request(f"t{i}"), beats) for i in range(1, 201)]  # same tokens
    # A coin toss: at most a block's Bloom false positive (~0.2% a key) ever matches.
    assert 60 < sum(p.engine_id == "theirs" for p in placed) < 140
    assert max(p.cached_tokens for p in placed) <= 16


def test_an_engine_holding_the_adapter_is_preferred_among_equals():
    request = _request(adapter="tuned", adapter_hash=ADAPTER)
    beats = [_beat("without"), _beat("with", adapters=[ADAPTER]),
             _beat("other", adapters=["b" * 64])]
    assert {Router().place(request, beats).engine_id for _ in range(20)} == {"with"}


def test_the_adapter_hit_rate_counts_placements_on_an_engine_holding_the_adapter():
    from prometheus_client import REGISTRY

    def count(policy: str, resident: str) -> float:
        return REGISTRY.get_sample_value("atrium_routing_adapter_placements_total",
                                         {"policy": policy, "resident": resident}) or 0.0

    before = {k: count("scored", k) for k in ("yes", "no")}
    request = _request(adapter="tuned", adapter_hash=ADAPTER)
    Router().place(request, [_beat("without"), _beat("with", adapters=[ADAPTER])])
    Router().place(_request(adapter="tuned", adapter_hash="c" * 64), [_beat("without")])
    Router().place(_request(), [_beat("without")])  # no adapter: not counted
    assert count("scored", "yes") == before["yes"] + 1
    assert count("scored", "no") == before["no"] + 1


def test_a_deep_queue_outweighs_a_cached_prefix():
    request = _request()
    warm = _beat("warm", cached=_keys(request), waiting=4, queued=6)
    assert Router().place(request, [warm, _beat("idle")]).engine_id == "idle"
    full = _beat("warm", cached=_keys(request), kv_usage=0.99)
    assert Router().place(request, [full, _beat("idle")]).engine_id == "idle"


def test_what_this_process_sent_since_a_heartbeat_counts_as_load():
    beats = [_beat("e1"), _beat("e2"), _beat("e3")]  # nothing to cache
    router = Router()
    placements = [(router.place(r, beats), r) for r in (_request(prompt=[1, 2, 3])
                                                       for _ in range(30))]
    placed = collections.Counter(p.engine_id for p, _ in placements)
    assert placed == {"e1": 10, "e2": 10, "e3": 10}
    # Those e1 started no longer wait there: e1 gets the next ones.
    for placement, sent in placements:
        if placement.engine_id == "e1":
            router.started(placement, sent.request_id)
    assert {router.place(_request(prompt=[1, 2, 3]), beats).engine_id
            for _ in range(5)} == {"e1"}


def test_a_session_stays_on_its_engine_across_web_processes_and_sessions_spread():
    request = _request(prompt=[1, 2, 3])
    beats = [_beat("e1"), _beat("e2"), _beat("e3")]
    homes = {}
    for session in (f"conversation-{i}" for i in range(60)):
        first = Router().place(request, beats, session=session).engine_id
        assert {Router().place(request, beats, session=session).engine_id
                for _ in range(5)} == {first}  # any web process, any time
        homes[session] = first
    assert min(collections.Counter(homes.values()).values()) >= 8  # spread over all three
    # The session's engine gets busy: its conversation goes elsewhere rather than wait.
    session = "conversation-0"
    busy = [_beat(b.engine_id, waiting=12) if b.engine_id == homes[session] else b
            for b in beats]
    assert Router().place(request, busy, session=session).engine_id != homes[session]
    # Sessions are per tenant: another tenant's same session id is hashed apart.
    others = {Router().place(_request("t2", prompt=[1, 2, 3]), beats,
                             session=s).engine_id == homes[s] for s in homes}
    assert others == {True, False}


def test_a_sessions_engine_is_one_that_holds_its_adapter_where_any_does():
    beats = [_beat("e1"), _beat("e2", adapters=["sql"]), _beat("e3", adapters=["sql"])]
    homes = collections.Counter(
        Router().place(_request(prompt=[1, 2, 3], adapter="sql", adapter_hash="sql"), beats,
                       session=f"conversation-{i}").engine_id for i in range(30))
    assert set(homes) == {"e2", "e3"}  # spread over the two that hold it, never a load
    # An adapter no engine holds: every engine may be home, as for the base model.
    homes = {Router().place(_request(prompt=[1, 2, 3], adapter="new", adapter_hash="new"),
                            beats, session=f"conversation-{i}").engine_id for i in range(30)}
    assert homes == {"e1", "e2", "e3"}


def test_when_no_engine_has_a_free_seat_the_request_waits_on_the_shared_stream():
    request = _request()
    router = Router()
    beats = [_beat("warm", cached=_keys(request), seats=4, running=2, waiting=2),
             _beat("cold", seats=4, running=2)]
    # The warm engine is full: the cold one has two seats left.
    assert [router.place(_request(), beats).engine_id for _ in range(2)] == ["cold", "cold"]
    # Now every seat is taken, as far as this process knows.
    overflow = router.place(_request(), beats)
    assert (overflow.stream, overflow.engine_id) == (protocol.request_stream("m"), None)
    # A fresh heartbeat frees the seats this process had counted.
    later = [_beat("cold", seats=4, running=1)]
    assert router.place(request, later).engine_id == "cold"


def test_random_and_shared_policies():
    request = _request()
    beats = [_beat("warm", cached=_keys(request)), _beat("cold")]
    spread = collections.Counter(Router().place(request, beats, policy="random").engine_id
                                 for _ in range(200))
    assert spread["warm"] > 50 and spread["cold"] > 50
    shared = Router().place(request, beats, policy="shared")
    assert (shared.stream, shared.engine_id) == (protocol.request_stream("m"), None)


def test_an_engine_of_an_earlier_version_gets_requests_on_the_shared_stream():
    request = _request()
    old = protocol.EngineHeartbeat(engine_id="old", model="m", started_at=0, sent_at=0)
    placement = Router().place(request, [old])
    assert (placement.stream, placement.engine_id) == (protocol.request_stream("m"), None)
    assert Router().place(request, [old, _beat("new")]).engine_id == "new"
    bare = _beat("bare")  # reads its stream, says nothing else (the reference engine)
    bare.placement = {"stream": True}
    assert Router().place(request, [bare]).engine_id == "bare"


def test_a_garbled_summary_counts_as_nothing_cached():
    request = _request()
    garbled = _beat("garbled")
    garbled.placement["prefix"] = {"block_size": 16, "bits": 1024, "filter": "!!"}
    assert Router().place(request, [garbled]).cached_tokens == 0


def test_a_summary_never_misses_a_cached_block_and_stays_bounded():
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(50_000)]
    summary = PrefixSummary.of(keys, 16)
    assert all(key in summary for key in keys[::97])
    assert summary.bits == MAX_BITS and len(summary.filter) == MAX_BITS // 8
    again = PrefixSummary.from_dict(summary.to_dict())
    assert again == summary
    small = PrefixSummary.of(keys[:100], 16)
    absent = [hashlib.sha256(f"absent {i}".encode()).digest() for i in range(1000)]
    assert sum(k in small for k in absent) < 30  # about 1% false positives


@pytest.mark.parametrize("raw", [None, "x", {}, {"block_size": 0, "bits": 1024, "filter": ""},
                                 {"block_size": 16, "bits": 999, "filter": ""},
                                 {"block_size": 16, "bits": 1024, "filter": "AAAA"}])
def test_a_malformed_summary_reads_as_none(raw):
    assert PrefixSummary.from_dict(raw) is None


def test_a_heartbeat_with_fields_this_version_does_not_know_still_decodes():
    beat = _beat("e1")
    raw = beat.encode()[:-1] + ',"from_the_future":1}'
    assert protocol.EngineHeartbeat.decode(raw).engine_id == "e1"


def test_a_tenant_ahead_of_its_share_on_an_engine_is_placed_where_it_is_not():
    # Token-fair counters (engine/fair_share.py): on "busy" this tenant has had 3,000 weighted
    # tokens more than the least-served tenant waiting there; its request would wait there.
    request = _request(prompt=[1, 2, 3])
    ahead, even = _beat("busy"), _beat("even")
    ahead.placement["fair"] = {"t1": 3000, "t2": 5}
    even.placement["fair"] = {"t2": 3000}
    assert {Router().place(request, [ahead, even]).engine_id for _ in range(20)} == {"even"}
    # Another tenant's lead there is no reason to avoid it.
    other = _request(tenant="t3", prompt=[1, 2, 3])
    assert {Router().place(other, [ahead, even]).engine_id for _ in range(50)} == \
        {"busy", "even"}


@pytest.mark.parametrize("standing", [{"t1": "far"}, {"t1": float("nan")}, ["t1"], None])
def test_a_garbled_fair_standing_counts_as_even(standing):
    request = _request(prompt=[1, 2, 3])
    garbled = _beat("garbled")
    garbled.placement["fair"] = standing
    placed = {Router().place(request, [garbled, _beat("plain")]).engine_id for _ in range(50)}
    assert placed == {"garbled", "plain"}
