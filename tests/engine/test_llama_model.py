"""The engine's own forward pass against Hugging Face transformers, logits for logits.

Each checkpoint is a random-weight model that transformers builds and saves itself,
in Hugging Face layout; the engine loads it through the same code as any checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.batch import ScheduledRequest, SchedulerOutput
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.model_config import ModelConfig
from engine.sampling_params import SamplingParams

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

CASES = {
    "llama-gqa-untied": ("LlamaConfig", {}),
    "llama-tied-mha": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama-rope-linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear",
                                                           "factor": 2.0}}),
    "llama3-rope": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, "rope_theta": 500000.0}),
    "llama-rope-yarn": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}),
    "llama-head-dim": ("LlamaConfig", {"head_dim": 32}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2-bias": ("Qwen2Config", {}),
}


def build_checkpoint(out: Path, kind: str, overrides: dict, *, dtype=torch.float32,
                     shard: str | None = None) -> Path:
    import transformers

    config = getattr(transformers, kind)(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # the default init leaves norms at 1 and biases at 0: vary them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, max_shard_size=shard or "1GB")
    return out


def engine_logits(model_dir: Path, prompt: list[int], *, chunk: int, dtype: str = "float32"
                  ) -> torch.Tensor:
    """Logits at every position, prefilling in chunks of ``chunk`` through the paged cache."""
    cfg = ModelConfig.from_dir(model_dir)
    runner = ModelRunner(EngineConfig(model_dir=model_dir, dtype=dtype, num_kv_blocks=64,
                                      block_size=4), cfg, cfg.max_position_embeddings)
    logits = []
    table = list(range(64))[::-1]  # blocks out of order, as a real pool hands them out
    params = SamplingParams(max_tokens=1, temperature=0.0)
    captured: list[torch.Tensor] = []
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]
    for start in range(0, len(prompt), chunk):
        ids = prompt[start:start + chunk]
        # One request per position keeps every row's logits: sample at each chunk end.
        runner.run(SchedulerOutput([ScheduledRequest(
            request_id="r", token_ids=ids, start_pos=start, block_table=table, sample=True,
            sampling=params)]))
        logits.append(captured[-1])
    return torch.cat(logits)  # [chunks, vocab]: the logits at each chunk's last position


def hf_logits(model_dir: Path, prompt: list[int], dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float()  # [positions, vocab]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    kind, overrides = CASES[case]
    model_dir = build_checkpoint(tmp_path / case, kind, overrides)
    prompt = [(37 * i + 11) % BASE["vocab_size"] for i in range(150)]
    expected = hf_logits(model_dir, prompt)
    # Chunks of 7, then single tokens: prefill with and without a cached prefix, and decode.
    chunked = engine_logits(model_dir, prompt[:140], chunk=7)
    decoded = engine_logits(model_dir, prompt, chunk=1)
    torch.testing.assert_close(chunked, expected[6:140:7], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decoded, expected, atol=1e-4, rtol=1e-4)


def test_sharded_bfloat16_checkpoint_loads_and_matches(tmp_path):
    model_dir = build_checkpoint(tmp_path / "sharded", "LlamaConfig", {}, dtype=torch.bfloat16,
                                 shard="100KB")
    assert (model_dir / "model.safetensors.index.json").exists()
    prompt = [(13 * i + 5) % BASE["vocab_size"] for i in range(40)]
    expected = hf_logits(model_dir, prompt, dtype=torch.bfloat16)
    ours = engine_logits(model_dir, prompt, chunk=1, dtype="bfloat16")
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(ours, expected, atol=0.1, rtol=0.05)


def test_pickled_weights_are_refused(tmp_path):
    model_dir = build_checkpoint(tmp_path / "m", "LlamaConfig", {})
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    cfg = ModelConfig.from_dir(model_dir)
    with pytest.raises(ValueError, match="pickled"):
        ModelRunner(EngineConfig(model_dir=model_dir, num_kv_blocks=4), cfg, 64)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture"),
    ({"hidden_act": "gelu"}, "activation"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "RoPE type"),
])
def test_unsupported_configs_get_a_clear_error(tmp_path, change, message):
    model_dir = build_checkpoint(tmp_path / "m", "LlamaConfig", {})
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(model_dir)


def test_a_shape_mismatch_names_the_tensor(tmp_path):
    model_dir = build_checkpoint(tmp_path / "m", "LlamaConfig", {})
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "intermediate_size": 80}))
    cfg = ModelConfig.from_dir(model_dir)
    with pytest.raises(ValueError, match="mlp"):
        ModelRunner(EngineConfig(model_dir=model_dir, num_kv_blocks=4), cfg, 64)


def test_building_a_runner_in_half_precision_leaves_torchs_defaults_alone(tiny_model_dir):
    """The runner makes its weights in its dtype without touching torch's global default."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # a caller's own choice, kept as it was
    try:
        runner = ModelRunner(EngineConfig(model_dir=tiny_model_dir, dtype="bfloat16",
                                          num_kv_blocks=8),
                             ModelConfig.from_dir(tiny_model_dir), max_model_len=64)
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(before)
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
