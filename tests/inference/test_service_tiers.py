"""service_tier on the live API (docs/tiers.md), through the openai SDK: what a plan offers,
what the answer says, what reaches the engine, and flex's 429 when no engine starts it."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from engine import protocol
from tests.factories import key_factory, plan_factory, tenant_factory
from tests.inference.slow_engine import SlowEngine
from tests.live import start_engine
from tests.waiting import wait_for

MESSAGES = [{"role": "user", "content": "Hi"}]


def _client(api_server: str, key: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_server}/v1", api_key=key, max_retries=0,
                         timeout=timeout)


def _key_on_plan(**plan) -> str:
    tenant = tenant_factory(plan=plan_factory(**plan))
    return key_factory(tenant).plaintext


def test_each_offered_tier_is_served_and_named_in_the_answer(api_server, served_model,
                                                             engine_worker):
    client = _client(api_server, _key_on_plan(service_tiers=["default", "flex", "priority"]))
    for asked, named in ((None, "default"), ("auto", "default"), ("default", "default"),
                         ("flex", "flex"), ("priority", "priority"), ("fast", "priority")):
        extra = {} if asked is None else {"service_tier": asked}
        answer = client.chat.completions.create(model=served_model, messages=MESSAGES,
                                                max_tokens=2, **extra)
        assert answer.service_tier == named, asked
    chunks = list(client.chat.completions.create(
        model=served_model, messages=MESSAGES, max_tokens=2, stream=True,
        stream_options={"include_usage": True}, service_tier="priority"))
    assert {c.service_tier for c in chunks} == {"priority"}
    # The SDK's completions.create has no service_tier argument: the body says it.
    legacy = client.completions.create(model=served_model, prompt="Hi", max_tokens=2,
                                       extra_body={"service_tier": "flex"})
    assert legacy.model_extra["service_tier"] == "flex"


def test_auto_is_the_plans_default_tier(api_server, served_model, engine_worker):
    client = _client(api_server, _key_on_plan(service_tiers=["priority", "default"],
                                              default_service_tier="priority"))
    answer = client.chat.completions.create(model=served_model, messages=MESSAGES, max_tokens=2)
    assert answer.service_tier == "priority"


@pytest.mark.parametrize("asked", ["priority", "fast", "scale", "turbo", 3])
def test_a_tier_the_plan_lacks_is_refused_naming_the_parameter(api_server, served_model,
                                                               redis_client, asked):
    key = _key_on_plan()  # the default plan's tiers: default and flex
    answer = httpx.post(f"{api_server}/v1/chat/completions", timeout=30,
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": served_model, "messages": MESSAGES,
                              "service_tier": asked})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "service_tier"
    assert not any(redis_client.xlen(s) for s in (protocol.request_stream(served_model),))


def test_the_engine_is_told_the_tier_weight_price_class_and_flex_wait(
        api_server, served_model, redis_client):
    key = _key_on_plan(service_tiers=["default", "flex", "priority"], fair_weight=3.0)
    # A heartbeat with no engine behind it, of an engine that reads the tiers' lanes:
    # requests are queued in their lanes and stay there.
    beat = protocol.EngineHeartbeat(engine_id="ghost", model=served_model,
                                    started_at=time.time(), sent_at=time.time() + 30,
                                    placement={"stream": True, "lanes": True})
    redis_client.zadd(protocol.ENGINES_ZSET, {"ghost": beat.sent_at})
    redis_client.set(protocol.engine_key("ghost"), beat.encode())

    def queued(tier: str, timeout: float) -> tuple[protocol.EngineRequest, float]:
        """The engine request a call of ``tier`` queued in its lane, and when it was sent."""
        stream = protocol.lane_stream(served_model, protocol.lane_of(tier))
        before = redis_client.xlen(stream)
        sent = time.time()

        def send() -> None:
            try:
                _client(api_server, key, timeout=timeout).chat.completions.create(
                    model=served_model, messages=MESSAGES, max_tokens=2, service_tier=tier)
            except openai.APITimeoutError:
                pass  # nobody answers; the server cancels it when the client hangs up

        sender = threading.Thread(target=send)
        sender.start()
        wait_for(lambda: redis_client.xlen(stream) > before, timeout=10)
        request = protocol.EngineRequest.decode(redis_client.xrange(stream)[-1][1])
        sender.join()
        return request, sent

    flex, sent = queued("flex", timeout=3)
    assert (flex.service_tier, flex.price_class, flex.fair_weight) == ("flex", "flex", 3.0)
    # The SDK's own timeout (x-stainless-read-timeout: 3), less a second for the answer.
    assert sent + 1.5 < flex.queue_deadline < sent + 2.5
    priority, _ = queued("priority", timeout=2)
    assert (priority.service_tier, priority.price_class, priority.queue_deadline) == \
        ("priority", "priority", None)


@pytest.fixture
def one_seat_engine(served_model, tiny_model_path, redis_client):
    """A real engine with one seat, slowed down: a long default request fills it."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    def factory(model_dir):
        return SlowEngine(LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=512,
                                                 max_num_seqs=1)), 0.03)

    running = start_engine(tiny_model_path, served_model, "one-seat", engine_factory=factory)
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


def _usage_report(redis_client, request_id: str) -> protocol.UsageReport:
    def found():
        for stream in protocol.usage_streams(redis_client):
            for _, fields in redis_client.xrange(stream):
                report = protocol.UsageReport.decode(fields)
                if report.request_id == request_id:
                    return report
        return None

    return wait_for(found, timeout=10)


def test_flex_waiting_past_its_clients_timeout_gets_a_429_that_costs_nothing(
        api_server, served_model, one_seat_engine, redis_client):
    key = _key_on_plan()
    long_one = threading.Thread(target=lambda: _client(api_server, key).chat.completions.create(
        model=served_model, messages=MESSAGES, max_tokens=150))
    long_one.start()
    wait_for(lambda: one_seat_engine_running(redis_client), timeout=20)
    # The SDK's timeout bounds its wait for the answer (httpx's read timeout, 3 s from the
    # request sent): a 429 rather than APITimeoutError is the answer before the client gave up.
    # (A wall clock around the call also counts this busy machine's connect and GIL waits.)
    with pytest.raises(openai.RateLimitError) as refused:
        _client(api_server, key, timeout=3).chat.completions.create(
            model=served_model, messages=MESSAGES, max_tokens=5, service_tier="flex")
    error = refused.value
    assert error.code == "resource_unavailable"
    request_id = error.response.headers["x-request-id"]
    report = _usage_report(redis_client, request_id)
    assert report.finish_reason == protocol.FINISH_QUEUE_TIMEOUT
    assert report.price_class == "flex"
    assert report.usage["prompt_tokens"] == 0 and report.usage["completion_tokens"] == 0
    long_one.join(timeout=60)


def one_seat_engine_running(redis_client) -> bool:
    raw = redis_client.get(protocol.engine_key("one-seat"))
    return raw is not None and protocol.EngineHeartbeat.decode(raw).running >= 1


@pytest.fixture
def full_engine(served_model, tiny_model_path, redis_client):
    """A real engine with one seat and room for one waiting request, slowed down: what
    arrives past those waits in Redis."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    def factory(model_dir):
        return SlowEngine(LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=512,
                                                 max_num_seqs=1, max_waiting=1)), 0.02)

    running = start_engine(tiny_model_path, served_model, "full", engine_factory=factory)
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


def test_a_priority_request_overtakes_default_ones_queued_in_redis(api_server, served_model,
                                                                   full_engine, redis_client):
    key = _key_on_plan(service_tiers=["default", "priority"])
    finished: list[str] = []

    def call(name: str, tier: str, max_tokens: int) -> threading.Thread:
        def run() -> None:
            _client(api_server, key).chat.completions.create(
                model=served_model, messages=MESSAGES, max_tokens=max_tokens, service_tier=tier)
            finished.append(name)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    threads = [call("running", "default", 60)]
    wait_for(lambda: _heartbeat(redis_client, "full").running >= 1, timeout=20)
    threads += [call(f"queued-{i}", "default", 10) for i in range(3)]
    # One waits in the engine, two in Redis behind it.
    wait_for(lambda: _heartbeat(redis_client, "full").queued + redis_client.xlen(
        protocol.request_stream(served_model)) >= 2, timeout=20)
    threads.append(call("priority", "priority", 10))
    for thread in threads:
        thread.join(timeout=120)
    assert finished.index("priority") < min(finished.index(f"queued-{i}") for i in range(3)), \
        finished


def _heartbeat(redis_client, engine_id: str) -> protocol.EngineHeartbeat:
    raw = redis_client.get(protocol.engine_key(engine_id))
    assert raw is not None
    return protocol.EngineHeartbeat.decode(raw)
