"""Multi-LoRA serving against PEFT: one mixed batch, each adapter as PEFT computes it alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from lora_testing import peft_greedy, peft_logits, train_adapter
from test_llm_engine import drain, request, tokens

from engine import protocol
from engine.batch import ScheduledRequest, SchedulerOutput
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.adapter import AdapterError, LoRAAdapter, LoRAModule, load_adapter
from engine.lora.store import AdapterStore, content_hash
from engine.models.model_config import ModelConfig
from engine.sampling_params import SamplingParams

MAX_NEW = 12
ADAPTERS = {  # name -> training options: ranks 8/16/64, different targets, scalings
    "all-r8": dict(seed=1, r=8),
    "attn-r16-rslora": dict(seed=2, r=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                            use_rslora=True),
    "mlp-r64-pattern": dict(seed=3, r=64, lora_alpha=32,
                            targets=["gate_proj", "up_proj", "down_proj"],
                            alpha_pattern={"down_proj": 8}),
    "qv-r16": dict(seed=4, r=16, targets=["q_proj", "v_proj"]),
}
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300], list(range(40, 73)), [900] * 20 + [17]]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (the PEFT folder, its hash in the store)."""
    root = tmp_path_factory.mktemp("adapters")
    store = AdapterStore(root / "store")
    out = {}
    for name, options in ADAPTERS.items():
        folder = train_adapter(tiny_model_dir, root / name, **options)
        out[name] = (folder, store.put(folder))
    return out


@pytest.fixture(scope="module")
def store_root(adapters) -> Path:
    return next(iter(adapters.values()))[0].parent / "store"


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters) -> dict[str | None, list[list[int]]]:
    out = {None: peft_greedy(tiny_model_dir, None, PROMPTS, MAX_NEW)}
    for name, (folder, _) in adapters.items():
        out[name] = peft_greedy(tiny_model_dir, folder, PROMPTS, MAX_NEW)
    return out


def engine(tiny_model_dir, store_root, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=tiny_model_dir, adapter_store=store_root, **options))


def adapter_request(rid, prompt, name, adapters, **kw) -> protocol.EngineRequest:
    kw.setdefault("max_tokens", MAX_NEW)
    return request(rid, prompt, adapter=name, adapter_hash=adapters[name][1] if name else None,
                   **kw)


def submit_mixed(eng: LLMEngine, adapters) -> list[tuple[str, str | None, int]]:
    """Every prompt for every adapter and for the base model, interleaved, all at once."""
    jobs = []
    for p in range(len(PROMPTS)):
        for name in [None, *ADAPTERS]:
            rid = f"{name}-{p}"
            eng.add_request(adapter_request(rid, PROMPTS[p], name, adapters))
            jobs.append((rid, name, p))
    return jobs


def test_every_adapter_changes_the_output(expected):
    for name in ADAPTERS:
        assert expected[name] != expected[None], name


@pytest.mark.parametrize("options", [
    {}, {"max_loras": 2, "max_num_batched_tokens": 32},
    # drafts verified with each row's own adapter applied
    {"speculative": "ngram", "speculative_max_batch": 64}],
    ids=["slots-for-all", "two-slots", "speculative"])
def test_mixed_batch_equals_peft_for_each_adapter_alone(tiny_model_dir, store_root, adapters,
                                                        expected, options):
    eng = engine(tiny_model_dir, store_root, **options)
    seen_per_step = []
    schedule = eng.scheduler.schedule

    def spy():
        batch = schedule()
        seen_per_step.append({r.adapter_slot for r in batch.requests if r.adapter_slot >= 0})
        return batch

    eng.scheduler.schedule = spy
    jobs = submit_mixed(eng, adapters)
    outputs = drain(eng)
    for rid, name, p in jobs:
        assert tokens(outputs[rid]) == expected[name][p], (rid, name)
    assert max(len(s) for s in seen_per_step) == min(len(ADAPTERS), eng.config.max_loras)
    assert max(len(s) for s in seen_per_step) <= eng.config.max_loras
    if eng.config.speculative != "off":
        assert eng.metrics.spec_accepted_tokens > 0


def _engine_logits(runner, prompt: list[int], slot: int, adapter_hash: str) -> torch.Tensor:
    """Logits at every position of ``prompt`` through the runner, one token per step."""
    captured = []
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for pos, token in enumerate(prompt):
        runner.run(SchedulerOutput([ScheduledRequest(
            request_id="r", token_ids=[token], start_pos=pos, block_table=list(range(8)),
            sample=True, sampling=params, adapter_slot=slot, adapter_hash=adapter_hash)]))
    runner.model.compute_logits = original
    return torch.cat(captured)


def test_logits_agree_with_peft(tiny_model_dir, store_root, adapters):
    eng = engine(tiny_model_dir, store_root, num_kv_blocks=8)
    prompt = PROMPTS[2][:24]
    for slot, (name, (folder, adapter_hash)) in enumerate(adapters.items()):
        eng.runner.lora.load_slot(slot, eng.adapters.cache.load_now(adapter_hash))
        ours = _engine_logits(eng.runner, prompt, slot, adapter_hash)
        torch.testing.assert_close(ours, peft_logits(tiny_model_dir, folder, prompt),
                                   atol=1e-4, rtol=1e-4, msg=name)


def test_triton_kernels_in_the_engine_match_peft(tiny_model_dir, store_root, adapters,
                                                 expected):
    eng = engine(tiny_model_dir, store_root, use_triton=True, num_kv_blocks=64)
    names = ["all-r8", "mlp-r64-pattern"]
    for name in [None, *names]:
        eng.add_request(adapter_request(f"{name}", PROMPTS[1], name, adapters, max_tokens=4))
    outputs = drain(eng)
    for name in [None, *names]:
        assert tokens(outputs[f"{name}"]) == expected[name][1][:4]


def test_prefix_cache_never_crosses_adapters(tiny_model_dir, store_root, adapters):
    eng = engine(tiny_model_dir, store_root)
    prompt = list(range(100, 164))
    eng.add_request(adapter_request("a", prompt, "all-r8", adapters))
    drain(eng)
    eng.add_request(adapter_request("b", prompt, "qv-r16", adapters))
    eng.add_request(adapter_request("base", prompt, None, adapters))
    eng.add_request(adapter_request("a-again", prompt, "all-r8", adapters))
    outputs = drain(eng)
    assert outputs["b"][-1].usage.cached_tokens == 0
    assert outputs["base"][-1].usage.cached_tokens == 0
    assert outputs["a-again"][-1].usage.cached_tokens == 48


def test_pinned_adapters_stay_in_their_slots(tiny_model_dir, store_root, adapters, expected):
    pinned = adapters["qv-r16"][1]
    eng = engine(tiny_model_dir, store_root, max_loras=2, pinned_adapters=(pinned,))
    for i, name in enumerate(["all-r8", "attn-r16-rslora", "mlp-r64-pattern", "qv-r16"] * 2):
        eng.add_request(adapter_request(f"{name}-{i}", PROMPTS[0], name, adapters))
    outputs = drain(eng)
    assert eng.scheduler.slots.slot_of[pinned] == 0
    assert tokens(outputs["qv-r16-3"]) == expected["qv-r16"][0]
    assert tokens(outputs["mlp-r64-pattern-6"]) == expected["mlp-r64-pattern"][0]


def test_a_pinned_adapter_is_in_its_slot_from_start_up_and_through_idle_steps(
        tiny_model_dir, store_root, adapters, expected):
    pinned = adapters["qv-r16"][1]
    eng = engine(tiny_model_dir, store_root, max_loras=2, pinned_adapters=(pinned,))
    assert eng.runner.lora.slot_hash[0] == pinned
    assert eng.step() == []  # nothing to run yet
    eng.add_request(adapter_request("p", PROMPTS[0], "qv-r16", adapters))
    outputs = drain(eng)
    assert outputs["p"][-1].error is None
    assert tokens(outputs["p"]) == expected["qv-r16"][0]


def test_an_engine_whose_pins_fill_every_slot_refuses_other_adapters(tiny_model_dir, store_root,
                                                                    adapters, expected):
    pinned = adapters["qv-r16"][1]
    eng = engine(tiny_model_dir, store_root, max_loras=1, pinned_adapters=(pinned,))
    with pytest.raises(ValueError, match="pinned adapters fill"):
        eng.add_request(adapter_request("other", PROMPTS[0], "all-r8", adapters))
    assert not eng.has_unfinished()
    eng.add_request(adapter_request("p", PROMPTS[0], "qv-r16", adapters))
    eng.add_request(adapter_request("base", PROMPTS[0], None, adapters))
    outputs = drain(eng)
    assert tokens(outputs["p"]) == expected["qv-r16"][0]
    assert tokens(outputs["base"]) == expected[None][0]


def test_a_failed_slot_load_never_serves_the_previous_adapter(tiny_model_dir, store_root,
                                                              adapters, expected):
    eng = engine(tiny_model_dir, store_root, max_loras=1)
    eng.add_request(adapter_request("a", PROMPTS[0], "all-r8", adapters))
    drain(eng)
    real = eng.runner.copy_adapter

    def fails_once(slot, adapter):
        eng.runner.copy_adapter = real
        raise OSError("the copy failed")

    eng.runner.copy_adapter = fails_once
    eng.add_request(adapter_request("b", PROMPTS[0], "qv-r16", adapters))
    assert "the copy failed" in drain(eng)["b"][-1].error
    eng.add_request(adapter_request("b-again", PROMPTS[0], "qv-r16", adapters))
    assert tokens(drain(eng)["b-again"]) == expected["qv-r16"][0]


def test_the_runner_refuses_a_row_whose_slot_holds_another_adapter(tiny_model_dir, store_root,
                                                                   adapters):
    eng = engine(tiny_model_dir, store_root, num_kv_blocks=8)
    eng.runner.copy_adapter(0, eng.adapters.cache.load_now(adapters["all-r8"][1]))
    row = ScheduledRequest(request_id="r", token_ids=[5], start_pos=0, block_table=[0],
                           sample=True, sampling=SamplingParams(max_tokens=1, temperature=0.0),
                           adapter_slot=0, adapter_hash=adapters["qv-r16"][1])
    with pytest.raises(RuntimeError, match="does not hold adapter"):
        eng.runner.run(SchedulerOutput([row]))
    eng.adapters.cache.load_now(adapters["qv-r16"][1])
    eng.adapters.fill_slots(eng.runner, [row])  # what the engine does before every step
    assert eng.runner.adapter_in_slot(0) == adapters["qv-r16"][1]
    assert eng.runner.run(SchedulerOutput([row])).sampled[0] is not None


def test_a_slot_whose_copy_failed_part_way_names_no_adapter(tiny_model_dir, store_root,
                                                            adapters):
    eng = engine(tiny_model_dir, store_root, num_kv_blocks=8)
    lora = eng.runner.lora
    lora.load_slot(0, eng.adapters.cache.load_now(adapters["all-r8"][1]))
    good = eng.adapters.cache.load_now(adapters["qv-r16"][1])
    key, module = list(good.modules.items())[-1]
    misshapen = LoRAModule(module.a[:, :3], module.b, module.scaling)
    broken = LoRAAdapter(good.adapter_hash, good.rank, {**good.modules, key: misshapen})
    with pytest.raises(RuntimeError):
        lora.load_slot(0, broken)
    assert lora.slot_hash[0] is None


def test_requests_for_an_unknown_or_unloadable_adapter_fail_clearly(tiny_model_dir, store_root,
                                                                    adapters, tmp_path):
    eng = engine(tiny_model_dir, store_root)
    with pytest.raises(ValueError, match="not in the adapter store"):
        eng.add_request(request("x", [1, 2], adapter="ghost", adapter_hash="0" * 64))
    with pytest.raises(ValueError, match="hex"):
        eng.add_request(request("x", [1, 2], adapter="evil", adapter_hash="../../etc"))
    # A stored adapter that turns out unservable fails its request, not the engine.
    broken = tmp_path / "broken"
    shutil.copytree(adapters["all-r8"][0], broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    bad_hash = AdapterStore(store_root).put(broken)
    eng.add_request(request("bad", [1, 2], adapter="broken", adapter_hash=bad_hash))
    eng.add_request(adapter_request("good", PROMPTS[0], "all-r8", adapters))
    outputs = drain(eng)
    assert "use_dora" in outputs["bad"][-1].error
    assert outputs["bad"][-1].error_code == protocol.ERROR_INVALID_REQUEST
    assert outputs["good"][-1].finish_reason in ("stop", "length")


def test_an_engine_without_a_store_refuses_adapter_requests(tiny_model_dir, adapters):
    eng = LLMEngine(EngineConfig(model_dir=tiny_model_dir))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        eng.add_request(adapter_request("x", [1, 2], "all-r8", adapters))


# -- the loader's checks --------------------------------------------------------------------

def _variant(folder: Path, tmp_path: Path, *, config: dict | None = None,
             tensors=None) -> Path:
    out = tmp_path / "variant"
    shutil.copytree(folder, out)
    if config is not None:
        path = out / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        weights = load_file(out / "adapter_model.safetensors")
        save_file(tensors(weights), out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize("change, message", [
    (dict(config={"use_dora": True}), "use_dora"),
    (dict(config={"r": 200}), "above"),
    (dict(config={"target_modules": ["q_proj", "embed_tokens"]}), "not supported"),
    (dict(config={"peft_type": "IA3"}), "peft_type"),
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(tensors=lambda w: {**w, "base_model.model.lm_head.lora_A.weight":
                                  torch.zeros(8, 64)}), "not a LoRA weight"),
    (dict(tensors=lambda w: {k: v[:, :10].contiguous() if "q_proj.lora_A" in k else v
                             for k, v in w.items()}), "another model"),
    (dict(tensors=lambda w: {k: v for k, v in w.items() if "q_proj.lora_B" not in k}),
     "without its other half"),
    (dict(tensors=lambda w: {k: v * float("nan") if "k_proj.lora_B" in k else v
                             for k, v in w.items()}), "NaN"),
    (dict(config={"rank_pattern": [8]}), "rank_pattern must be an object"),
    (dict(config={"alpha_pattern": {"q_proj": "sixteen"}}), "must be a positive number"),
    (dict(config={"alpha_pattern": {"q_proj(": 16}}), "not a valid pattern"),
    (dict(config={"alpha_pattern": {"x" * 300: 16}}), "longer than"),
    # Nested quantifiers that backtrack exponentially on a module name: the match is cut
    # off and the adapter refused, the worker is not held.
    (dict(config={"alpha_pattern": {"((?:[a-z]|[a-z._0-9])*)*[.]{5}": 16}}), "too long to match"),
])
def test_the_loader_refuses_what_it_cannot_serve(tiny_model_dir, adapters, tmp_path, change,
                                                 message):
    folder = _variant(adapters["all-r8"][0], tmp_path, **change)
    with pytest.raises(AdapterError, match=message):
        load_adapter(folder, ModelConfig.from_dir(tiny_model_dir), max_rank=64)


def test_pickled_and_corrupt_weights_are_refused(tiny_model_dir, adapters, tmp_path):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    folder = _variant(adapters["all-r8"][0], tmp_path)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickle"):
        load_adapter(folder, cfg, max_rank=64)
    (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(AdapterError, match="cannot be read"):
        load_adapter(folder, cfg, max_rank=64)


def test_rank_up_to_128_is_supported(tiny_model_dir, tmp_path):
    folder = train_adapter(tiny_model_dir, tmp_path / "r128", seed=9, r=128, steps=1)
    adapter = load_adapter(folder, ModelConfig.from_dir(tiny_model_dir), max_rank=128)
    assert adapter.rank == 128
    with pytest.raises(AdapterError, match="above"):
        load_adapter(folder, ModelConfig.from_dir(tiny_model_dir), max_rank=64)


def test_the_store_names_content_by_hash(adapters, tmp_path):
    folder, stored = adapters["all-r8"]
    assert content_hash(folder) == stored
    store = AdapterStore(tmp_path / "s")
    assert store.put(folder) == stored and store.put(folder) == stored
    with pytest.raises(ValueError):
        store.path("../../etc/passwd")


def test_a_deleted_adapter_is_let_go_of_once_idle(tiny_model_dir, store_root, adapters):
    eng = engine(tiny_model_dir, store_root)
    digest = adapters["all-r8"][1]
    eng.add_request(adapter_request("a", PROMPTS[0], "all-r8", adapters))
    drain(eng)
    assert digest in eng.adapters and digest in eng.scheduler.slots.slot_of
    eng.forget_adapter(digest)
    assert digest not in eng.adapters and digest not in eng.scheduler.slots.slot_of


def test_the_worker_hears_of_deleted_adapters(tiny_model_dir, store_root, adapters,
                                              redis_client):
    from engine.worker import Worker, WorkerConfig

    eng = engine(tiny_model_dir, store_root)
    digest = adapters["qv-r16"][1]
    eng.adapters.cache.load_now(digest)
    worker = Worker(redis_client, eng, model_name="tiny", engine_id="e", config=WorkerConfig())
    worker._adapter_events_id = worker._last_entry_id(protocol.ADAPTER_EVENTS_STREAM)
    redis_client.xadd(protocol.ADAPTER_EVENTS_STREAM,
                      {"type": "deleted", "adapter_hash": digest})
    worker.read_adapter_events()
    assert digest not in eng.adapters


def test_an_adapter_starting_to_load_is_in_a_heartbeat_at_once(tiny_model_dir, store_root,
                                                               adapters, redis_client):
    """The web tier places the next requests for an adapter where it is loading: the
    engine's heartbeat names it as soon as its load begins, not a second later."""
    import time

    from engine.worker import Worker, WorkerConfig

    eng = engine(tiny_model_dir, store_root)
    worker = Worker(redis_client, eng, model_name="tiny", engine_id="e", config=WorkerConfig())
    worker.streams.ensure_groups()
    worker.heartbeat()

    def named() -> list[str]:
        beat = protocol.EngineHeartbeat.decode(redis_client.get(protocol.engine_key("e")))
        return beat.placement["adapters"]

    assert named() == []
    digest = adapters["qv-r16"][1]
    eng.add_request(adapter_request("r1", PROMPTS[0], "qv-r16", adapters))
    assert eng.adapters.resident() == [digest]  # on its way to host memory: counted
    time.sleep(0.15)  # past the early heartbeat's spacing, well before the next second's
    worker.tick()
    assert named() == [digest]


def test_metrics_name_the_adapters_running_and_waiting(tiny_model_dir, store_root, adapters):
    """vllm:lora_requests_info as vLLM writes it (what the inference extension's endpoint
    picker reads), and the adapter extras: load times and slot evictions."""
    from prometheus_client.parser import text_string_to_metric_families

    from engine.metrics import render_prometheus

    def scrape() -> dict[str, list]:
        text = render_prometheus(eng.snapshot(), model_name="tiny", engine="e1")
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    eng = engine(tiny_model_dir, store_root, max_loras=2)
    names = list(ADAPTERS)[:3]
    for name in names:
        eng.add_request(adapter_request(name, PROMPTS[1], name, adapters, ignore_eos=True))
    while eng.num_running() < 2:  # adapters load in the background
        eng.step()
    [info] = scrape()["vllm:lora_requests_info"]
    running = info.labels["running_lora_adapters"].split(",")
    assert info.labels["max_lora"] == "2" and len(running) == 2
    assert set(running) | {info.labels["waiting_lora_adapters"]} == set(names)
    assert info.value > 1e9  # when: a Unix time, as vLLM's
    ended = drain(eng)
    # Each request waited for its adapter's load before it queued (its trace's span).
    for name in running:
        usage = ended[name][-1].usage
        assert 0 < usage.adapter_wait_s <= usage.queue_s
    metrics = scrape()
    [info] = metrics["vllm:lora_requests_info"]
    assert info.labels["running_lora_adapters"] == info.labels["waiting_lora_adapters"] == ""
    loads = {s.name: s.value for s in metrics["atrium_engine_adapter_load_seconds"]
             if not s.labels.get("le")}
    assert loads["atrium_engine_adapter_load_seconds_count"] == 3
    assert loads["atrium_engine_adapter_load_seconds_sum"] > 0
    # The third adapter took the slot of one that had finished.
    [evictions] = metrics["atrium_engine_adapter_slot_evictions"]
    assert evictions.value == 1
    # Each request's adapter was copied into a slot for it (no two shared one), and none was
    # in host memory when its request arrived.
    tiers = {name: metrics[f"atrium_engine_adapter_{name}"][0].value
             for name in ("slot_hits", "slot_misses", "host_hits", "host_misses")}
    assert tiers == {"slot_hits": 0, "slot_misses": 3, "host_hits": 0, "host_misses": 3}
    eng.add_request(adapter_request("again", PROMPTS[1], names[2], adapters))
    drain(eng)
    metrics = scrape()
    assert metrics["atrium_engine_adapter_slot_hits"][0].value == 1
    assert metrics["atrium_engine_adapter_host_hits"][0].value == 1
