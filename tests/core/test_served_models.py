"""The platform tokenizes exactly as transformers does, without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.served_models import load_served_model

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Sure? ünïcødé 🚀"}],
]


@pytest.fixture(scope="module")
def both(tiny_model_path):
    from transformers import AutoTokenizer

    return (load_served_model(tiny_model_path, "tiny"),
            AutoTokenizer.from_pretrained(tiny_model_path))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_ids_equal_apply_chat_template(both, messages):
    ours, hf = both
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    assert ours.encode_chat(messages) == list(expected)


@settings(max_examples=50, deadline=None)
@given(st.text(min_size=1, max_size=200))
def test_prompt_ids_equal_the_hf_tokenizer(both, text):
    ours, hf = both
    assert ours.encode_prompt(text) == hf(text)["input_ids"]


def test_context_window_comes_from_the_checkpoint(both, tiny_model_path):
    import json

    config = json.loads((tiny_model_path / "config.json").read_text())
    assert both[0].context_window == config["max_position_embeddings"]


def test_the_inference_api_does_not_import_torch():
    code = ("import django, os, sys; os.environ['DJANGO_SETTINGS_MODULE']='atrium.settings'; "
            "django.setup(); import inference.views, inference.consumers, "
            "atrium.asgi; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("window, use, expected", [(64, None, 64), (4096, None, "full"),
                                                    (64, False, "full")])
def test_a_sliding_window_caps_the_served_context_as_the_engine_does(
        tiny_model_path, tmp_path, window, use, expected):
    import shutil

    from engine.models.model_config import ModelConfig

    model = tmp_path / "windowed"
    shutil.copytree(tiny_model_path, model)
    config = json.loads((model / "config.json").read_text())
    config.update(sliding_window=window, model_type="qwen2",
                  architectures=["Qwen2ForCausalLM"])
    if use is not None:
        config["use_sliding_window"] = use
    (model / "config.json").write_text(json.dumps(config))
    served = load_served_model(model, "windowed").context_window
    full = config["max_position_embeddings"]
    assert served == (full if expected == "full" else expected)
    assert served == ModelConfig.from_dir(model).max_position_embeddings
