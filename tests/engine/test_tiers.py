"""Service tiers and token-fair scheduling in the scheduler alone (engine/tiers.py,
engine/fair_share.py, engine/fair_queue.py)."""

from __future__ import annotations

import time

import pytest

from engine import protocol
from engine.fair_share import OUTPUT_COST, PROMPT_COST, ServiceCounters
from engine.metrics import render_prometheus
from engine.scheduler import Scheduler
from tests.engine.scheduling import check_invariants, fake_tokens, run_to_completion, scheduler, seq

PRIORITY, DEFAULT, FLEX, BATCH = (protocol.TIER_PRIORITY, protocol.TIER_DEFAULT,
                                  protocol.TIER_FLEX, protocol.TIER_BATCH)


def step(sched: Scheduler) -> list[str]:
    batch = sched.schedule()
    check_invariants(sched, batch)
    sched.postprocess(batch, fake_tokens(batch))
    return [r.request_id for r in batch.requests]


def fill(sched: Scheduler, tenant: str, n: int, **options) -> list:
    """``n`` requests of ``tenant`` added and run one step: they hold the seats."""
    held = [seq(4, tenant=tenant, **options) for _ in range(n)]
    for s in held:
        sched.add(s)
    step(sched)
    return held


def served_while_backlogged(sched: Scheduler, make: dict[str, callable], steps: int,
                            backlog: int = 8) -> dict[str, float]:
    """Runs ``steps`` steps keeping ``backlog`` requests of each tenant in the engine; the
    weighted service (the counters' growth) each tenant received meanwhile."""
    def top_up() -> None:
        for tenant, new in make.items():
            while sum(s.tenant_id == tenant for s in sched.sequences.values()) < backlog:
                sched.add(new())

    top_up()  # a tenant's counter is lifted as it arrives: not service it received
    start = {tenant: sched.counters[tenant] for tenant in make}
    for _ in range(steps):
        step(sched)
        top_up()
    return {tenant: sched.counters[tenant] - start[tenant] for tenant in make}


def test_tenants_sending_long_and_short_prompts_get_equal_token_service():
    # A request of "long" is 10x one of "short": by request, "long" would get ~10x the
    # compute; by tokens, each gets half.
    sched = scheduler(num_blocks=512, block_size=4, max_num_seqs=4, budget=48)
    make = {"long": lambda: seq(160, tenant="long", max_tokens=4),
            "short": lambda: seq(16, tenant="short", max_tokens=4)}
    served_while_backlogged(sched, make, steps=60)  # warm up to a steady state
    served = served_while_backlogged(sched, make, steps=400)
    assert served["long"] == pytest.approx(served["short"], rel=0.10)


def test_a_tenant_with_twice_the_weight_gets_twice_the_tokens():
    sched = scheduler(num_blocks=512, block_size=4, max_num_seqs=4, budget=48)
    make = {"heavy": lambda: seq(32, tenant="heavy", max_tokens=4, weight=2.0),
            "light": lambda: seq(32, tenant="light", max_tokens=4, weight=1.0)}
    served_while_backlogged(sched, make, steps=60)
    served = served_while_backlogged(sched, make, steps=400)
    # The counters divide by the weight: equal counters are a 2:1 split of tokens.
    assert served["heavy"] == pytest.approx(served["light"], rel=0.10)
    tokens = {t: sum(n for (tenant, _), n in sched.metrics.served.items() if tenant == t)
              for t in make}
    assert tokens["heavy"] / tokens["light"] == pytest.approx(2.0, rel=0.15)


def test_a_tenant_back_from_idle_banks_no_credit():
    sched = scheduler(num_blocks=512, block_size=4, max_num_seqs=4, budget=48)
    alone = {"a": lambda: seq(32, tenant="a", max_tokens=4)}
    served_while_backlogged(sched, alone, steps=200)
    both = {**alone, "b": lambda: seq(32, tenant="b", max_tokens=4)}
    served = served_while_backlogged(sched, both, steps=100)
    # Without lifting, "b" (counter 0) would take every step until it caught up with "a".
    assert served["a"] == pytest.approx(served["b"], rel=0.15)


def test_counters_charge_prompt_and_output_once_not_recomputation_or_cache_hits():
    counters = ServiceCounters()
    s = seq(8, tenant="t", max_tokens=4)
    counters.arrive("t")
    # Positions 0-1 came from the prefix cache; the rest of the prompt is charged as it
    # is admitted, though only its first chunk runs now.
    assert counters.charge(s, 2, 3) == 3
    assert counters["t"] == 6 * PROMPT_COST
    assert counters.charge(s, 5, 3) == 3
    assert counters["t"] == 6 * PROMPT_COST
    s.token_ids.append(100)
    assert counters.charge(s, 8, 1) == 1
    assert counters["t"] == 6 * PROMPT_COST + OUTPUT_COST
    assert counters.charge(s, 0, 9) == 0  # recomputed after a preemption
    assert counters["t"] == 6 * PROMPT_COST + OUTPUT_COST
    counters.leave("t")
    assert counters.active() == []


def test_a_priority_request_at_a_full_engine_starts_before_waiting_default_requests():
    sched = scheduler(max_num_seqs=2, budget=64)
    running = fill(sched, "a", 2, max_tokens=20)
    waiting = [seq(4, tenant="b", max_tokens=4) for _ in range(3)]
    for s in waiting:
        sched.add(s)
    urgent = seq(4, tenant="c", max_tokens=4, tier=PRIORITY)
    sched.add(urgent)
    assert urgent.request_id in step(sched)
    assert running[1] not in sched.running  # the latest default one gave its seat
    assert all(s.scheduled_at is None for s in waiting)
    outputs = run_to_completion(sched)
    assert all(outputs[s.request_id][-1].finished for s in [*running, *waiting])


def test_priority_requests_are_preempted_last_when_kv_runs_out():
    # 6 blocks of 4: three 8-token prompts fill the pool; the next tokens need a block each.
    sched = scheduler(num_blocks=6, block_size=4, budget=100)
    first = seq(8, tenant="a", max_tokens=8, tier=PRIORITY)
    later = [seq(8, tenant="b", max_tokens=8) for _ in range(2)]
    sched.add(later[0])
    sched.add(later[1])
    step(sched)
    sched.add(first)  # the priority one arrives last, and takes a seat from a default one
    for _ in range(3):
        step(sched)
    assert first in sched.running and first.num_preemptions == 0
    outputs = run_to_completion(sched)
    assert outputs[first.request_id][-1].finish_reason == protocol.FINISH_LENGTH


def test_kv_pressure_preempts_the_tenant_most_over_its_share():
    sched = scheduler(num_blocks=6, block_size=4, budget=100)
    hog, modest = seq(8, tenant="hog", max_tokens=8), seq(8, tenant="modest", max_tokens=8)
    sched.add(hog)
    sched.add(modest)
    step(sched)
    sched.counters.arrive("hog")
    sched.counters.charge(seq(400, tenant="hog"), 0, 400)  # "hog" was served much more
    while sched.num_preemptions == 0:  # until the pool runs out
        step(sched)
    assert hog.num_preemptions == 1  # it arrived first, but had been served the most
    assert modest.num_preemptions == 0
    outputs = run_to_completion(sched)
    assert all(outputs[s.request_id][-1].finished for s in (hog, modest))


@pytest.mark.parametrize("fair_share", ["tokens", "requests"])
def test_a_tenant_holding_every_seat_yields_them_down_to_its_share(fair_share):
    sched = Scheduler(scheduler().kv, max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=1024, fair_share=fair_share)
    hogs = fill(sched, "hog", 4, max_tokens=50)
    quiet = [seq(4, tenant="quiet", max_tokens=50) for _ in range(3)]
    for s in quiet:
        sched.add(s)
    for _ in range(6):
        step(sched)
    holding = [sum(s.tenant_id == t for s in sched.running) for t in ("hog", "quiet")]
    if fair_share == "requests":  # the scheduler before token fairness: seats go as they free
        assert holding == [4, 0] and sched.num_preemptions == 0
        return
    # Two tenants, four seats: "quiet" took two, each from the latest of "hog"'s; its
    # third waits, since "hog" keeps its share.
    assert holding == [2, 2] and quiet[2].scheduled_at is None
    assert [h.num_preemptions for h in hogs] == [0, 0, 1, 1]
    outputs = run_to_completion(sched)
    assert all(outputs[s.request_id][-1].finished for s in (*hogs, *quiet))


def test_a_seat_is_not_taken_from_a_plan_of_higher_priority():
    sched = scheduler(max_num_seqs=4, budget=64)
    fill(sched, "hog", 4, max_tokens=50, priority=0)
    lower = seq(4, tenant="lower", max_tokens=50, priority=1)
    sched.add(lower)
    for _ in range(4):
        step(sched)
    assert lower.scheduled_at is None and sched.num_preemptions == 0


def test_reserved_seats_are_left_for_the_priority_tier():
    sched = scheduler(max_num_seqs=3, budget=64)
    sched.reserve_seats = 1
    for _ in range(4):
        sched.add(seq(4, tenant="a", max_tokens=10))
    step(sched)
    assert len(sched.running) == 2  # one seat kept
    urgent = seq(4, tenant="b", max_tokens=4, tier=PRIORITY)
    sched.add(urgent)
    assert urgent.request_id in step(sched)
    assert sched.num_preemptions == 0


def test_flex_runs_before_batch_and_never_delays_a_default_first_token_past_one_step():
    sched = scheduler(max_num_seqs=8, budget=64, num_blocks=256)
    for _ in range(3):
        sched.add(seq(4, tenant="a", max_tokens=30, tier=BATCH))
    flex = [seq(4, tenant="a", max_tokens=30, tier=FLEX) for _ in range(3)]
    for s in flex:
        sched.add(s)
    first = step(sched)
    assert set(first) >= {s.request_id for s in flex}
    for _ in range(3):
        step(sched)
    interactive = seq(12, tenant="b", max_tokens=3)
    sched.add(interactive)
    ran = step(sched)
    # Its prefill runs beside the flex decodes only: batch work and flex prompts sit out.
    assert interactive.request_id in ran and set(ran) <= {interactive.request_id,
                                                          *(s.request_id for s in flex)}
    assert interactive.first_token_at is not None  # the one step after it came


def test_a_flex_request_not_started_by_its_queue_deadline_ends_unrun_and_unbilled():
    sched = scheduler(max_num_seqs=1, budget=64)
    busy = seq(4, tenant="a", max_tokens=50)
    sched.add(busy)
    step(sched)
    flex = seq(4, tenant="b", max_tokens=4, tier=FLEX)
    flex.queue_deadline = time.time() - 1
    sched.add(flex)
    ended = sched.expire()
    assert [(o.request_id, o.finish_reason) for o in ended] == \
        [(flex.request_id, protocol.FINISH_QUEUE_TIMEOUT)]
    assert ended[0].usage.prompt_tokens == 0 and ended[0].usage.completion_tokens == 0
    assert busy in sched.running and not sched.expire()


def test_a_started_request_outlives_its_queue_deadline():
    sched = scheduler(max_num_seqs=4, budget=64)
    started = seq(4, tenant="a", max_tokens=10, tier=FLEX)
    sched.add(started)
    step(sched)
    started.queue_deadline = time.time() - 1
    assert sched.expire() == []


def test_tier_metrics_reach_the_exposition():
    sched = scheduler(max_num_seqs=4, budget=64)
    sched.add(seq(4, tenant="acme", max_tokens=2, tier=PRIORITY))
    sched.add(seq(4, tenant="zeta", max_tokens=2, tier=FLEX))
    run_to_completion(sched)
    m = sched.metrics
    snapshot = {"requests_finished": m.requests_finished, "tiers": m.tiers_snapshot(),
                "served": m.served_snapshot()}
    text = render_prometheus(snapshot, model_name="demo", engine="e1")
    assert 'atrium_engine_tier_time_to_first_token_seconds_count{engine="e1",' \
           'model_name="demo",service_tier="priority"} 1.0' in text
    assert 'atrium_engine_tokens_served_total{engine="e1",model_name="demo",' \
           'service_tier="flex",tenant="zeta"} 5.0' in text  # 4 prompt tokens, 1 decode


def test_the_request_protocol_names_tiers_and_refuses_what_it_does_not_know():
    base = protocol.EngineRequest(request_id="r", model="m", prompt_token_ids=[1],
                                  sampling=protocol.SamplingSpec(max_tokens=4), tenant_id="t")
    for field, value in (("service_tier", "turbo"), ("fair_weight", 0),
                         ("fair_weight", 1e9)):
        fields = base.encode()
        raw = fields["data"].replace('"fair_weight":1.0', f'"{field}":{value!r}'.replace(
            "'", '"')) if field == "fair_weight" else fields["data"].replace(
            '"service_tier":"default"', '"service_tier":"turbo"')
        with pytest.raises(ValueError, match=field):
            protocol.EngineRequest.decode({"data": raw})
    # An earlier web tier's batch line: the batch priority and no tier.
    old = protocol.EngineRequest(request_id="r", model="m", prompt_token_ids=[1],
                                 sampling=protocol.SamplingSpec(max_tokens=4), tenant_id="t",
                                 priority=protocol.BATCH_PRIORITY)
    assert protocol.tier_of(old) == BATCH


def test_each_lane_waits_in_the_engine_with_a_room_of_its_own(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=64, max_waiting=2))

    def add(rid: str, tier: str) -> None:
        engine.add_request(protocol.EngineRequest(
            request_id=rid, model="tiny", prompt_token_ids=[1, 2, 3], tenant_id="t",
            sampling=protocol.SamplingSpec(max_tokens=2), service_tier=tier))

    rooms = lambda: (engine.room(), engine.lane_room(protocol.LANE_PRIORITY),  # noqa: E731
                     engine.lane_room(protocol.LANE_SPARE))
    assert rooms() == (2, 2, 2)
    add("f1", FLEX)
    add("b1", BATCH)
    assert rooms() == (2, 2, 0)  # spare work takes none of the default tier's room
    add("p1", PRIORITY)
    add("d1", DEFAULT)
    assert rooms() == (1, 1, 0)


def test_request_fair_share_takes_tenants_in_turn_by_request_whatever_their_length():
    sched = Scheduler(scheduler().kv, max_num_seqs=4, max_num_batched_tokens=48,
                      max_model_len=1024, fair_share="requests")
    make = {"long": lambda: seq(160, tenant="long", max_tokens=4),
            "short": lambda: seq(16, tenant="short", max_tokens=4)}
    served_while_backlogged(sched, make, steps=400)
    tokens = {t: sum(n for (tenant, _), n in sched.metrics.served.items() if tenant == t)
              for t in make}
    assert tokens["long"] > 3 * tokens["short"]  # by request, long prompts take more


def test_a_long_prompt_already_running_leaves_the_step_to_a_less_served_tenants_request():
    sched = scheduler(max_num_seqs=8, budget=64, num_blocks=256)
    hog = seq(400, tenant="hog", max_tokens=4)
    sched.add(hog)
    step(sched)  # its first chunk: 64 of 400 prompt tokens, all charged at admission
    quiet = seq(8, tenant="quiet", max_tokens=4)
    sched.add(quiet)
    batch = sched.schedule()
    tokens = {r.request_id: len(r.token_ids) for r in batch.requests}
    assert tokens == {quiet.request_id: 8, hog.request_id: 56}  # the hog's chunk is cut


def test_the_standing_names_the_tenants_ahead_of_the_least_served_waiting_one():
    counters = ServiceCounters()
    for tenant in ("hog", "modest"):
        counters.arrive(tenant)
        counters.queued(tenant)
    counters.charge(seq(400, tenant="hog"), 0, 400)
    counters.charge(seq(100, tenant="modest"), 0, 100)
    assert counters.standing(64) == {"hog": 300}
    assert counters.standing(0) == {}
