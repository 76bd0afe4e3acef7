"""Embed requests (protocol.TASK_EMBED): one vector per input, pooled from the final hidden
states as the checkpoint says (engine/pooling.py). The oracles: sentence-transformers'
``encode`` on the same checkpoint, and transformers' ``AutoModel`` (its last_hidden_state)."""

from __future__ import annotations

import base64
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_testing import cancel, read_events, submit
from test_llm_engine import drain, request, tokens
from test_parallel_sampling import assert_all_free
from tokenizers import Tokenizer

from engine import protocol
from engine.config import EngineConfig
from engine.demo_model import build_embedding_model, write_sentence_transformers_files
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.pooling import CLS, LAST, MEAN, Pooling, read_pooling

TEXTS = [
    "The sea is calm.",
    "An old sailor watches the quiet harbour in the morning while gulls circle the boats, "
    "and a curious child asks him about the storms he has seen on the long journeys of his "
    "youth, far beyond the island and the lighthouse.",
    "Hi",
    "A brave fox finds a golden key under the bridge near the river.",
]
BUDGET = 16  # tokens a step: the long input runs in several chunks
MODES = {"mean": MEAN, "cls": CLS, "lasttoken": LAST}


@pytest.fixture(scope="module")
def st_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """The demo embedding checkpoint (mean pooling), and the tiny checkpoint pooled the other
    ways; each normalised."""
    root = tmp_path_factory.mktemp("embedding-models")
    dirs = {"mean": build_embedding_model(root / "mean")}
    for pooling in ("cls", "lasttoken"):
        dirs[pooling] = Path(shutil.copytree(tiny_model_dir, root / pooling))
        write_sentence_transformers_files(dirs[pooling], pooling=pooling)
    return dirs


def embed_request(rid: str, inputs: list[list[int]], **fields) -> protocol.EngineRequest:
    return protocol.EngineRequest(
        request_id=rid, model="tiny", prompt_token_ids=inputs[0], extra_prompts=inputs[1:],
        sampling=protocol.SamplingSpec(max_tokens=1), tenant_id="t1", cache_salt="s1",
        task=protocol.TASK_EMBED, **fields)


def vectors(encoded: list[str]) -> np.ndarray:
    """The wire's vectors (base64 of little-endian float32) as [inputs, hidden]."""
    return np.stack([np.frombuffer(base64.b64decode(v), dtype="<f4") for v in encoded])


def engine(model_dir: Path, **options) -> LLMEngine:
    options.setdefault("block_size", 8)
    options.setdefault("num_kv_blocks", 256)
    options.setdefault("max_num_batched_tokens", BUDGET)
    return LLMEngine(EngineConfig(model_dir=model_dir, **options))


def embed(eng: LLMEngine, rid: str, inputs: list[list[int]]) -> tuple[np.ndarray, RequestOutput]:
    eng.add_request(embed_request(rid, inputs))
    (final,) = drain(eng)[rid]  # no output but the final one
    assert final.finished and final.finish_reason == "stop" and final.error is None
    return vectors(final.embeddings), final


def encode(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids as the platform makes them from text (a completions prompt: BOS first)."""
    return [tokenizer.encode(text).ids for text in texts]


def sentence_transformers(model_dir: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu").encode(texts, convert_to_numpy=True)


def transformers_pooled(model_dir: Path, inputs: list[list[int]], mode: str) -> np.ndarray:
    """transformers' AutoModel (LlamaModel) last_hidden_state, pooled, normalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in inputs:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]  # [len, hidden]
            rows.append({MEAN: hidden.mean(dim=0), CLS: hidden[0], LAST: hidden[-1]}[mode])
    return F.normalize(torch.stack(rows), dim=-1).numpy()


# -- what the vectors are -------------------------------------------------------------------

@pytest.mark.parametrize("pooling", ["mean", "cls", "lasttoken"])
def test_embeddings_equal_sentence_transformers_encode(st_dirs, tokenizer, pooling):
    inputs = encode(tokenizer, TEXTS)
    assert max(map(len, inputs)) > 3 * BUDGET
    assert read_pooling(st_dirs[pooling]) == Pooling(MODES[pooling], normalize=True)
    got, final = embed(engine(st_dirs[pooling]), "e", inputs)
    np.testing.assert_allclose(got, sentence_transformers(st_dirs[pooling], TEXTS), atol=1e-5)
    assert final.usage.prompt_tokens == sum(map(len, inputs))
    assert final.usage.completion_tokens == 0 and final.usage.cached_tokens == 0


@pytest.mark.parametrize("pooling", ["mean", "cls", "lasttoken"])
def test_token_id_inputs_equal_transformers_last_hidden_state_pooled(st_dirs, pooling):
    # NOTE: not made from text, so no input starts with BOS: cls pooling sees each one's own
    # first token.
    inputs = [[(37 * i + 11 * n) % 1400 + 10 for i in range(n)] for n in (1, 5, 40, 150)]
    got, _ = embed(engine(st_dirs[pooling]), "e", inputs)
    np.testing.assert_allclose(got, transformers_pooled(st_dirs[pooling], inputs,
                                                        MODES[pooling]), atol=1e-5)


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 2048},  # each input in one chunk
    {"max_num_seqs": 2, "max_num_batched_tokens": 7, "block_size": 4},
], ids=["whole", "two-seats-odd-chunks"])
def test_inputs_pool_the_same_whole_or_in_chunks(st_dirs, options):
    inputs = [[(13 * i + 7 * n) % 1400 + 10 for i in range(n)] for n in (60, 55, 70, 3, 64)]
    eng = engine(st_dirs["mean"], **options)
    got, _ = embed(eng, "e", inputs)
    np.testing.assert_allclose(got, transformers_pooled(st_dirs["mean"], inputs, MEAN),
                               atol=1e-5)
    assert_all_free(eng)


def test_an_input_preempted_mid_way_runs_again_and_pools_as_in_one_piece(st_dirs):
    """A batch request's input gives its seat to an interactive one (engine/spare_capacity.py)
    after some of its chunks ran; it runs again from its first token."""
    long_input = [[(13 * i) % 1400 + 10 for i in range(100)]]
    eng = engine(st_dirs["mean"], max_num_seqs=1)
    eng.add_request(embed_request("batch", long_input, priority=protocol.BATCH_PRIORITY))
    assert eng.step() == [] and eng.step() == []
    eng.add_request(embed_request("interactive", [[10, 11, 12]]))
    outputs = drain(eng)
    assert eng.scheduler.num_preemptions == 1
    np.testing.assert_allclose(vectors(outputs["batch"][0].embeddings),
                               transformers_pooled(st_dirs["mean"], long_input, MEAN), atol=1e-5)
    assert outputs["batch"][0].usage.prompt_tokens == 100
    assert_all_free(eng)


def test_an_embedding_model_saved_by_sentence_transformers_6_embeds_as_it_does(
        tiny_model_dir, tmp_path):
    """Its own layout: a LlamaModel checkpoint (no lm_head, names without "model."), its
    module types and {"pooling_mode": "lasttoken"}."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    module = modules.Transformer(str(tiny_model_dir))
    st = SentenceTransformer(device="cpu", modules=[
        module, modules.Pooling(module.get_embedding_dimension(), pooling_mode="lasttoken"),
        modules.Normalize()])
    st.save(str(tmp_path / "saved"))
    assert read_pooling(tmp_path / "saved") == Pooling(LAST, normalize=True)
    batch = st.preprocess(TEXTS)  # its own tokens (it may wrap text in the chat template)
    inputs = [ids[mask.bool()].tolist()
              for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]
    eng = engine(tmp_path / "saved")
    got, _ = embed(eng, "e", inputs)
    np.testing.assert_allclose(got, st.encode(TEXTS, convert_to_numpy=True), atol=1e-5)
    assert eng.runner.model.lm_head is None


def test_a_checkpoint_without_a_language_model_head_embeds_only_and_only_when_asked(
        tiny_model_dir, tmp_path, tokenizer):
    from transformers import AutoModel

    AutoModel.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "base")  # LlamaModel
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path / "base")
    with pytest.raises(ValueError, match="has no language-model head: it can only embed"):
        engine(tmp_path / "base")
    eng = engine(tmp_path / "base", embeddings=True)
    inputs = encode(tokenizer, TEXTS)
    got, _ = embed(eng, "e", inputs)
    np.testing.assert_allclose(got, transformers_pooled(tiny_model_dir, inputs, LAST),
                               atol=1e-5)
    with pytest.raises(ValueError, match="serves embeddings only"):
        eng.add_request(request("g", inputs[0]))


def test_a_generative_model_with_embeddings_on_gives_normalised_last_hidden_states(
        tiny_model_dir, tokenizer):
    inputs = encode(tokenizer, TEXTS)
    eng = engine(tiny_model_dir, embeddings=True)
    got, _ = embed(eng, "e", inputs)
    np.testing.assert_allclose(got, transformers_pooled(tiny_model_dir, inputs, LAST),
                               atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    eng.add_request(request("g", inputs[0], max_tokens=4, ignore_eos=True))
    assert len(tokens(drain(eng)["g"])) == 4  # it still generates


def test_an_embedding_model_holds_no_lm_head(st_dirs):
    assert engine(st_dirs["mean"]).runner.model.lm_head is None


# -- batching -------------------------------------------------------------------------------

def test_embed_requests_batch_with_a_generate_request_and_leave_its_tokens_unchanged(
        tiny_model_dir, tokenizer):
    prompt = encode(tokenizer, TEXTS[3:])[0]
    inputs = [[(29 * i + n) % 1400 + 10 for i in range(n)] for n in (90, 70, 100)]
    alone_eng = engine(tiny_model_dir, embeddings=True)
    alone_eng.add_request(request("g", prompt, max_tokens=24, ignore_eos=True))
    alone = tokens(drain(alone_eng)["g"])
    embedded_alone, _ = embed(alone_eng, "e", inputs)

    eng = engine(tiny_model_dir, embeddings=True)
    eng.add_request(request("g", prompt, max_tokens=24, ignore_eos=True))
    eng.add_request(embed_request("e1", inputs[:2]))
    eng.add_request(embed_request("e2", inputs[2:]))
    outputs: dict[str, list[RequestOutput]] = {}
    together = 0  # steps after which both kinds run (so they share the next one)
    while eng.has_unfinished():
        for out in eng.step():
            outputs.setdefault(out.request_id, []).append(out)
        together += {s.embedding is not None for s in eng.scheduler.running} == {True, False}
    assert together >= 3
    assert tokens(outputs["g"]) == alone
    assert len(outputs["e1"]) == len(outputs["e2"]) == 1
    got = np.concatenate([vectors(outputs[r][0].embeddings) for r in ("e1", "e2")])
    np.testing.assert_allclose(got, embedded_alone, atol=1e-5)
    assert_all_free(eng)


def test_an_embed_input_never_reads_the_prefix_cache(st_dirs):
    inputs = [[(17 * i) % 1400 + 10 for i in range(40)]]
    eng = engine(st_dirs["mean"])
    first, _ = embed(eng, "a", inputs)
    again, final = embed(eng, "b", inputs)
    assert final.usage.cached_tokens == 0 and final.usage.prompt_tokens == 40
    assert eng.kv.stats.hits == 0
    np.testing.assert_allclose(again, first, atol=1e-6)


def test_an_embed_request_of_256_inputs_gives_256_vectors_in_order(st_dirs):
    inputs = [[(7 * i + k) % 1400 + 10 for i in range(2 + k % 5)] for k in range(256)]
    eng = engine(st_dirs["mean"], max_num_batched_tokens=512)
    got, final = embed(eng, "e", inputs)
    assert got.shape == (256, 64)
    picked = [0, 1, 128, 255]
    np.testing.assert_allclose(got[picked], transformers_pooled(
        st_dirs["mean"], [inputs[k] for k in picked], MEAN), atol=1e-5)
    assert final.usage.prompt_tokens == sum(map(len, inputs))
    assert_all_free(eng)


# -- refusals and endings -------------------------------------------------------------------

def test_257_inputs_are_refused(st_dirs):
    with pytest.raises(ValueError, match="257 inputs exceed the 256 an embed request may have"):
        engine(st_dirs["mean"]).add_request(embed_request("e", [[10, 11]] * 257))


def test_a_generate_request_keeps_its_cap_of_16_prompts(tiny_model_dir):
    eng = engine(tiny_model_dir, embeddings=True)
    generate = request("g", [10, 11], max_tokens=2)
    generate.extra_prompts = [[10, 11]] * 16
    with pytest.raises(ValueError, match="17 prompts exceed the 16"):
        eng.add_request(generate)


def test_an_engine_without_embeddings_refuses_an_embed_request_naming_the_model(
        tiny_model_dir, reference_engine_factory):
    with pytest.raises(ValueError, match="^model tiny does not serve embeddings$"):
        engine(tiny_model_dir).add_request(embed_request("e", [[10, 11]]))
    with pytest.raises(ValueError, match="model tiny does not serve embeddings"):
        reference_engine_factory().add_request(embed_request("e", [[10, 11]]))


def test_an_embedding_model_refuses_a_generate_request_naming_the_model(st_dirs):
    with pytest.raises(ValueError, match="^model tiny serves embeddings only$"):
        engine(st_dirs["mean"]).add_request(request("g", [10, 11]))


def test_an_input_longer_than_the_context_is_refused(st_dirs):
    with pytest.raises(ValueError, match="input 1 has 2049 tokens; this model's context holds "
                                         "2048$"):
        engine(st_dirs["mean"]).add_request(embed_request("e", [[10], [10] * 2049]))


def test_an_aborted_embed_request_ends_once_without_vectors_and_frees_its_blocks(st_dirs):
    eng = engine(st_dirs["mean"])
    eng.add_request(embed_request("e", [[10 + i % 50 for i in range(100)]] * 3))
    assert eng.step() == []
    out = eng.abort_request("e", protocol.FINISH_CANCELLED)
    assert out.finished and out.finish_reason == "cancelled" and out.embeddings is None
    assert out.choices is None and out.usage.prompt_tokens == BUDGET
    assert not eng.has_unfinished() and eng.step() == []
    assert_all_free(eng)


def test_an_embed_request_past_its_deadline_ends_with_deadline(st_dirs):
    eng = engine(st_dirs["mean"], max_num_batched_tokens=8)
    long_inputs = [[10 + i % 50 for i in range(2000)]] * 8  # about 2,000 steps of 8 tokens
    eng.add_request(embed_request("e", long_inputs, deadline=time.time() + 0.2))
    outputs = drain(eng)["e"]
    assert [(o.finished, o.finish_reason, o.embeddings) for o in outputs] == [
        (True, "deadline", None)]
    assert_all_free(eng)


# -- on the wire ----------------------------------------------------------------------------

def test_a_worker_writes_one_finish_with_base64_float32_embeddings_and_no_delta(
        start_worker, redis_client, st_dirs, tokenizer):
    start_worker(engine_factory=lambda _: engine(st_dirs["mean"]))
    inputs = encode(tokenizer, TEXTS)
    embed_req = embed_request("e", inputs)
    submit(redis_client, embed_req)
    events = read_events(redis_client, "e")
    assert [e.type for e in events] == [protocol.EV_ACCEPTED, protocol.EV_FINISH]
    final = events[-1].data
    assert set(final) == {"finish_reason", "usage", "embeddings"}
    assert final["finish_reason"] == "stop"
    assert final["usage"]["prompt_tokens"] == sum(map(len, inputs))
    assert final["usage"]["completion_tokens"] == 0
    np.testing.assert_allclose(vectors(final["embeddings"]),
                               sentence_transformers(st_dirs["mean"], TEXTS), atol=1e-5)


def test_a_worker_refuses_an_embed_request_its_model_does_not_serve(start_worker, redis_client):
    start_worker(engine_factory=lambda model_dir: engine(model_dir))
    submit(redis_client, embed_request("e", [[10, 11]]))
    (event,) = read_events(redis_client, "e")
    assert (event.type, event.data["code"], event.data["message"]) == (
        protocol.EV_ERROR, protocol.ERROR_INVALID_REQUEST, "model tiny does not serve embeddings")


def test_an_embed_request_cancelled_before_it_starts_finishes_cancelled_without_choices(
        start_worker, redis_client, st_dirs):
    embed_req = embed_request("e", [[10, 11]] * 3)
    cancel(redis_client, embed_req)
    start_worker(engine_factory=lambda _: engine(st_dirs["mean"]))
    submit(redis_client, embed_req)
    (event,) = read_events(redis_client, "e")
    assert event.type == protocol.EV_FINISH and event.data["finish_reason"] == "cancelled"
    assert "choices" not in event.data and "embeddings" not in event.data


# -- the operator's switch ------------------------------------------------------------------

@pytest.mark.parametrize("argv, env, on", [
    ([], None, False), (["--embeddings"], None, True), ([], "1", True), ([], "0", False)])
def test_embeddings_are_turned_on_by_flag_or_environment(tiny_model_dir, monkeypatch, argv,
                                                         env, on):
    import argparse

    from engine.options import add_engine_arguments, engine_factory_from_args

    if env is not None:
        monkeypatch.setenv("ATRIUM_ENGINE_EMBEDDINGS", env)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args([*argv, "--device", "cpu", "--kv-cache-mib", "1"])
    eng = engine_factory_from_args(args)(tiny_model_dir)
    assert eng.config.embeddings is on
    assert eng.pooling == (Pooling(LAST, normalize=True) if on else None) and eng.generates
