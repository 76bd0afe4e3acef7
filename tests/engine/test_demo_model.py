from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from engine import demo_model
from engine.demo_model import BOS, build_model, ensure_demo_model

FILES = ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
         "tokenizer.json", "tokenizer_config.json"]


def test_two_builds_with_one_seed_are_byte_identical(tiny_model_dir: Path, tmp_path: Path):
    again = build_model(tmp_path / "again", size="tiny", seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_another_seed_gives_other_weights(tiny_model_dir: Path, tmp_path: Path):
    other = build_model(tmp_path / "other", size="tiny", seed=1)
    assert (other / "model.safetensors").read_bytes() != \
        (tiny_model_dir / "model.safetensors").read_bytes()


def test_config_is_a_float32_llama_with_gqa_and_untied_embeddings(tiny_model_dir: Path):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == 2048


def test_checkpoint_loads_with_transformers_auto_classes(tiny_model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tok)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert tok.bos_token == BOS and tok.eos_token == demo_model.EOS
    assert tok("hello world")["input_ids"][0] == tok.bos_token_id


def test_vocab_is_between_one_and_two_thousand(tokenizer: Tokenizer):
    assert 1000 <= tokenizer.get_vocab_size() <= 2000
    for special in demo_model.SPECIAL_TOKENS:
        assert tokenizer.token_to_id(special) is not None


def test_chat_template_renders_through_apply_chat_template(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|system|>\nBe brief.<|end|>\n"
                    "<|user|>\nHello there<|end|>\n<|assistant|>\n")
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not without.endswith("<|assistant|>\n")


def test_transformers_and_tokenizers_agree_on_ids(tiny_model_dir: Path, tokenizer: Tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The old sailor finds 3 boats. Ünïcödé 🦊"
    assert tok(text)["input_ids"] == tokenizer.encode(text).ids
    messages = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == tokenizer.encode(rendered, add_special_tokens=False).ids


def test_chat_template_rejects_unknown_roles(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(Exception, match="roles must be"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_chat_template_accepts_tool_results(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "tool", "content": "42"}], tokenize=False)
    assert text == "<|begin_of_text|><|user|>\n<tool_response>\n42\n</tool_response><|end|>\n"


def test_a_new_chat_template_is_a_new_cached_demo_model(tmp_path: Path, monkeypatch):
    before = demo_model.demo_model_dir(tmp_path)
    monkeypatch.setattr(demo_model, "CHAT_TEMPLATE", demo_model.CHAT_TEMPLATE + " ")
    assert demo_model.demo_model_dir(tmp_path) != before


def test_special_tokens_in_chat_text_encode_as_single_ids(tokenizer: Tokenizer):
    ids = tokenizer.encode("<|user|>\nhi<|end|>", add_special_tokens=False).ids
    assert ids[0] == tokenizer.token_to_id("<|user|>")
    assert ids[-1] == tokenizer.token_to_id("<|end|>")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8")))
def test_any_unicode_text_round_trips_through_the_tokenizer(tokenizer: Tokenizer, text: str):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_encoding_with_special_tokens_prepends_bos_once(tokenizer: Tokenizer):
    ids = tokenizer.encode("The sea is calm.").ids
    assert ids[0] == tokenizer.token_to_id(BOS)
    assert ids.count(tokenizer.token_to_id(BOS)) == 1


@pytest.fixture
def tiny_demo(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Makes the demo size tiny (fast) and records every build_model call."""
    monkeypatch.setitem(demo_model.SIZES, "demo", demo_model.SIZES["tiny"])
    calls: list[Path] = []
    real = demo_model.build_model

    def spy(out_dir: Path, **kwargs) -> Path:
        calls.append(out_dir)
        return real(out_dir, **kwargs)

    monkeypatch.setattr(demo_model, "build_model", spy)
    return calls


def test_ensure_demo_model_builds_once_then_reuses_the_cache(tiny_demo, tmp_path: Path):
    first = ensure_demo_model(tmp_path)
    second = ensure_demo_model(tmp_path)
    assert first == second and len(tiny_demo) == 1
    assert first.parent == tmp_path / "models" and first.name.startswith("atrium-demo-")
    assert all((first / name).exists() for name in FILES)
    assert [p.name for p in first.parent.iterdir()] == [first.name]


def test_ensure_demo_model_defaults_to_atrium_home(tiny_demo, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ATRIUM_HOME", str(tmp_path / "home"))
    assert ensure_demo_model().parent == tmp_path / "home" / "models"


def test_a_crashed_build_leaves_no_half_model(tiny_demo, tmp_path: Path, monkeypatch):
    def crash(out_dir: Path, **kwargs) -> Path:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(demo_model, "build_model", crash)
    with pytest.raises(RuntimeError):
        ensure_demo_model(tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_the_demo_embedding_model_is_the_demo_model_in_the_sentence_transformers_layout(
        tiny_demo, tmp_path: Path):
    from engine.pooling import MEAN, Pooling, read_pooling

    first = demo_model.ensure_demo_embedding_model(tmp_path)
    assert demo_model.ensure_demo_embedding_model(tmp_path) == first and len(tiny_demo) == 1
    base = ensure_demo_model(tmp_path)
    assert first.parent == base.parent and first.name.startswith("atrium-demo-embedding-")
    for name in FILES:
        assert (first / name).read_bytes() == (base / name).read_bytes(), name
    assert read_pooling(first) == Pooling(MEAN, normalize=True)
    assert sorted(p.name for p in first.parent.iterdir()) == sorted([first.name, base.name])


def test_two_embedding_model_builds_are_byte_identical(tmp_path: Path):
    one = demo_model.build_embedding_model(tmp_path / "one", pooling="cls")
    two = demo_model.build_embedding_model(tmp_path / "two", pooling="cls")
    names = sorted(str(p.relative_to(one)) for p in one.rglob("*") if p.is_file())
    assert {"modules.json", "1_Pooling/config.json", "sentence_bert_config.json",
            "config_sentence_transformers.json"} <= set(names)
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


def _race(home: Path, builders: int) -> list[Path]:
    """``ensure_demo_model(home)`` from ``builders`` threads released at once."""
    results: list[Path] = []
    barrier = threading.Barrier(builders)

    def build() -> None:
        barrier.wait()
        results.append(ensure_demo_model(home))

    threads = [threading.Thread(target=build) for _ in range(builders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_racing_builds_agree_on_one_model(tiny_demo, tmp_path: Path):
    results = _race(tmp_path, 2)
    assert len(results) == 2 and results[0] == results[1]
    assert [p.name for p in (tmp_path / "models").iterdir()] == [results[0].name]


def test_requests_racing_in_one_process_build_the_model_once(tiny_demo, tmp_path: Path):
    results = _race(tmp_path, 4)
    assert len(results) == 4 and len(set(results)) == 1
    assert len(tiny_demo) == 1  # the others waited for it, then found the model built


# What each process runs: the demo size made tiny, each build marked with the builder's pid.
BUILDER = """
import os, sys, time
from pathlib import Path
from engine import demo_model
home, built = Path(sys.argv[1]), Path(sys.argv[2])
demo_model.SIZES["demo"] = demo_model.SIZES["tiny"]
real = demo_model.build_model
def marked(out_dir, **kwargs):
    (built / str(os.getpid())).touch()
    time.sleep(1.0)  # long enough for the other process to arrive while this one builds
    return real(out_dir, **kwargs)
demo_model.build_model = marked
print(demo_model.ensure_demo_model(home))
"""


def test_processes_sharing_a_home_build_the_model_once(tmp_path: Path):
    """Two processes (the test session's workers, an operator's two engines) that find no
    model at once: one builds it, the other waits for that build and uses it."""
    built = tmp_path / "built"
    built.mkdir()
    builders = [subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path), str(built)],
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=120)[0].strip() for process in builders]
    assert [process.returncode for process in builders] == [0, 0]
    assert outputs[0] == outputs[1] and Path(outputs[0]).parent == tmp_path / "models"
    assert len(list(built.iterdir())) == 1
    assert [p.name for p in (tmp_path / "models").iterdir()] == [Path(outputs[0]).name]


def test_cli_builds_into_the_given_folder(tmp_path: Path, capsys):
    demo_model.main([str(tmp_path / "cli"), "--size", "tiny", "--seed", "3"])
    assert (tmp_path / "cli" / "model.safetensors").exists()
    assert "built tiny model" in capsys.readouterr().out
