"""PEFT adapters trained in the tests: a few steps on the tiny model, deterministic."""

from __future__ import annotations

from pathlib import Path

import torch


def train_adapter(base_dir: Path, out_dir: Path, *, seed: int, r: int = 8,
                  lora_alpha: float = 16, targets: list[str] | None = None,
                  use_rslora: bool = False, alpha_pattern: dict | None = None,
                  steps: int = 12) -> Path:
    """A LoRA adapter nudged towards a seed-specific token sequence, so its output differs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=0.0, use_rslora=use_rslora,
                        target_modules=targets or ["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"],
                        alpha_pattern=alpha_pattern or {})
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    target = torch.randint(10, vocab, (4, 24), generator=gen)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad],
                                  lr=3e-2)
    peft_model.train()
    for _ in range(steps):
        loss = peft_model(input_ids=target, labels=target).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.eval()
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """PEFT's own greedy output for each prompt alone (the base model when no adapter)."""
    from transformers import AutoModelForCausalLM

    from engine.config import eos_token_ids

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    eos = sorted(eos_token_ids(Path(base_dir)))
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos or None, pad_token_id=eos[0] if eos else None)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def peft_logits(base_dir: Path, adapter_dir: Path, prompt: list[int]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float()  # [positions, vocab]


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(base_dir: Path, out_dir: Path, *, seed: int, r: int = 16,
                   lora_alpha: float | None = None) -> Path:
    """A LoRA adapter with seeded random weights on all seven projections, written in PEFT's
    layout directly (no model is loaded: a thousand take seconds, not an hour). Its B is not
    zero, so its output differs from the base model's and from other seeds'."""
    import json

    from safetensors.torch import save_file

    config = json.loads((Path(base_dir) / "config.json").read_text())
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (d_in, d_out) in shapes.items():
            part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, d_in, generator=gen) / d_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, r, generator=gen) / r ** 0.5 / 4
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
        "lora_alpha": lora_alpha if lora_alpha is not None else 2 * r, "lora_dropout": 0.0,
        "target_modules": list(ALL_TARGETS), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "base_model_name_or_path": str(base_dir)}, indent=1))
    return out_dir
