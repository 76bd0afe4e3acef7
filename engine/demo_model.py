"""Builds small Llama checkpoints in Hugging Face layout, deterministically from a seed.

Tests build the "tiny" size in a fraction of a second; ``atrium up`` serves the "demo" size,
built once and cached under ``$ATRIUM_HOME/models``. Both load through the same
code a real checkpoint uses (``AutoModelForCausalLM``, ``tokenizer.json``).

NOTE: torch is imported only while building, so ``ensure_demo_model`` costs a
path lookup (and no torch import) once the model is cached.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from engine import demo_corpus
from engine.demo_spec import ModelSpec
from engine.demo_template import CHAT_TEMPLATE, TOOL_PARSER

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

# Bump whenever the builder's output changes (weights, tokenizer, or the files beside them:
# the chat template lives in tokenizer_config.json): it is part of the cache key.
# 3: the chat template renders tools, tool calls and tool responses (Hermes format).
BUILDER_VERSION = 3
# The same for the files that make a checkpoint an embedding model (``build_embedding_model``).
EMBEDDING_BUILDER_VERSION = 1
DEMO_SEED = 0
# The BPE trainer stops earlier (about 1,500) once the corpus runs out of merges.
VOCAB_TARGET = 1536

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", END_OF_TURN]

SIZES: dict[str, ModelSpec] = {
    "tiny": ModelSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128),
    "demo": ModelSpec(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=512, train_steps=160),
    # A draft model for the demo (speculative decoding, docs/speculative.md): built with
    # the demo's seed it shares its tokenizer; a quarter of its width, half its depth.
    "demo-draft": ModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=256, train_steps=160),
}


def build_model(out_dir: Path, *, size: str = "tiny", seed: int = 0,
                spec: ModelSpec | None = None) -> Path:
    """Writes a complete Hugging Face checkpoint into ``out_dir`` and returns it: of one of
    the ``SIZES``, or of ``spec`` (benchmarks' shapes)."""
    if spec is None and size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    spec = spec or SIZES[size]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    eos_ids = [ids[EOS], ids[END_OF_TURN]]
    config = _config(spec, vocab_size, bos_id=ids[BOS], eos_ids=eos_ids)
    tensors = init_weights(spec, vocab_size, seed)
    if spec.train_steps:
        from engine.demo_train import train

        tensors = train(config, tensors, _training_tokens(tokenizer, seed), spec, seed)
    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids[BOS], "eos_token_id": eos_ids, "pad_token_id": ids[EOS],
        "do_sample": False})
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "pad_token": EOS, "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings, "chat_template": CHAT_TEMPLATE,
        "tool_parser": TOOL_PARSER})
    _write_json(out_dir / "special_tokens_map.json",
                {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS})
    for path in out_dir.iterdir():
        path.chmod(0o644)
    return out_dir


def build_embedding_model(out_dir: Path, *, seed: int = 0, size: str = "tiny",
                          pooling: str = "mean", normalize: bool = True) -> Path:
    """Writes an embedding model in the sentence-transformers layout into ``out_dir`` and
    returns it: ``build_model``'s checkpoint (the demo tokenizer, LlamaForCausalLM weights)
    with a Pooling module (``pooling``: "mean", "cls" or "lasttoken") and, with
    ``normalize``, a Normalize one. It loads in ``SentenceTransformer(out_dir)``."""
    out_dir = build_model(out_dir, size=size, seed=seed)
    write_sentence_transformers_files(out_dir, pooling=pooling, normalize=normalize)
    return out_dir


_POOLING_FLAGS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
                  "lasttoken": "pooling_mode_lasttoken"}
_OTHER_POOLING_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens")


def write_sentence_transformers_files(model_dir: Path, *, pooling: str = "mean",
                                      normalize: bool = True) -> None:
    """The files beside a checkpoint that make it a sentence-transformers model, in the
    layout most published ones have (that of sentence-transformers before 6, which 6 reads)."""
    if pooling not in _POOLING_FLAGS:
        raise ValueError(f"pooling must be cls, mean or lasttoken, got {pooling!r}")
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:  # NOTE: a Normalize module has no files of its own
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (model_dir / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    _write_json(model_dir / "1_Pooling" / "config.json", {
        "word_embedding_dimension": config["hidden_size"], "include_prompt": True,
        **dict.fromkeys(_OTHER_POOLING_FLAGS, False),
        **{flag: mode == pooling for mode, flag in _POOLING_FLAGS.items()}})
    _write_json(model_dir / "sentence_bert_config.json", {
        "max_seq_length": config["max_position_embeddings"], "do_lower_case": False})
    _write_json(model_dir / "config_sentence_transformers.json", {
        "__version__": {"sentence_transformers": "6.0.1"}, "prompts": {},
        "default_prompt_name": None, "similarity_fn_name": "cosine"})
    for path in [*model_dir.iterdir(), *(model_dir / "1_Pooling").iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def train_tokenizer(seed: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so any UTF-8 text round-trips."""
    # NOTE: the trainer's output does not depend on RAYON_NUM_THREADS (checked with 1 to 16);
    # tests/engine/test_demo_model.py keeps two builds byte-identical.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(demo_corpus.corpus(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return tokenizer


def init_weights(spec: ModelSpec, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Llama weights under Hugging Face names; norms start at one, the rest normal(0, std)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * spec.init_std

    tensors = {"model.embed_tokens.weight": normal(vocab_size, h)}  # [vocab, hidden]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(h, h),  # [heads * head_dim, hidden]
            p + "self_attn.k_proj.weight": normal(kv, h),  # [kv_heads * head_dim, hidden]
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(spec.intermediate_size, h),
            p + "mlp.up_proj.weight": normal(spec.intermediate_size, h),
            p + "mlp.down_proj.weight": normal(h, spec.intermediate_size),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = normal(vocab_size, h)  # untied from the embedding
    return tensors


def _config(spec: ModelSpec, vocab_size: int, *, bos_id: int, eos_ids: list[int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.head_dim,
        "hidden_act": "silu", "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "initializer_range": spec.init_std,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": False, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": bos_id, "eos_token_id": eos_ids,
    }


def _training_tokens(tokenizer: Tokenizer, seed: int) -> list[int]:
    """The corpus as one token stream: chats through the chat template, prose between BOS/EOS."""
    from jinja2 import Environment

    template = Environment().from_string(CHAT_TEMPLATE)
    rng = random.Random(seed + 1)
    stream: list[int] = []
    for _ in range(1500):
        if rng.random() < 0.6:
            sample = demo_corpus.chat_sample(rng)
            messages = ([{"role": "system", "content": sample.system}] if sample.system else [])
            messages += [{"role": "user", "content": sample.user},
                         {"role": "assistant", "content": sample.assistant}]
            text = template.render(messages=messages, bos_token=BOS)
            stream += tokenizer.encode(text, add_special_tokens=False).ids
        else:
            text = demo_corpus.paragraph(rng, rng.randint(1, 4))
            stream += tokenizer.encode(text).ids + [tokenizer.token_to_id(EOS)]
    return stream


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def atrium_home(home: Path | str | None = None) -> Path:
    return Path(home or os.environ.get("ATRIUM_HOME") or Path.home() / ".atrium").expanduser()


def demo_model_dir(home: Path | str | None = None, *, seed: int = DEMO_SEED) -> Path:
    """Where the demo model for this builder version, seed and spec lives (built or not)."""
    # NOTE: the template and tool format are in the key too, so editing them rebuilds a cached
    # model even where BUILDER_VERSION was not bumped.
    key = json.dumps({"builder": BUILDER_VERSION, "seed": seed, "spec": asdict(SIZES["demo"]),
                      "chat_template": CHAT_TEMPLATE, "tool_parser": TOOL_PARSER}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return atrium_home(home) / "models" / f"atrium-demo-{digest}"


_BUILDING = threading.Lock()


def ensure_demo_model(home: Path | str | None = None) -> Path:
    """Returns the cached demo model, building it first if this is the first call.

    The build goes into a temporary folder beside the target and is renamed into
    place, so a crashed build leaves no half model. Processes sharing the models folder
    build it once: the others wait for that build (a lock on the folder) and use it.
    """
    return _ensure(demo_model_dir(home),
                   lambda tmp: build_model(tmp, size="demo", seed=DEMO_SEED))


def demo_embedding_model_dir(home: Path | str | None = None) -> Path:
    """Where the demo embedding model made from the current demo model lives."""
    key = json.dumps({"builder": EMBEDDING_BUILDER_VERSION, "base": demo_model_dir(home).name})
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return atrium_home(home) / "models" / f"atrium-demo-embedding-{digest}"


def ensure_demo_embedding_model(home: Path | str | None = None) -> Path:
    """Returns the cached demo embedding model (``ensure_demo_model``'s tokenizer and
    weights in the sentence-transformers layout: mean pooling, normalised), building it
    first, and the demo model first of all if need be, as ``ensure_demo_model`` does."""
    target = demo_embedding_model_dir(home)
    if (target / "config.json").exists():
        return target
    base = ensure_demo_model(home)  # NOTE: before _ensure's locks, which it takes too

    def build(tmp: Path) -> None:
        for path in base.iterdir():
            shutil.copy2(path, tmp / path.name)
        write_sentence_transformers_files(tmp)

    return _ensure(target, build)


def _ensure(target: Path, build: Callable[[Path], object]) -> Path:
    if (target / "config.json").exists():
        return target
    # NOTE: one build per process: a web process's first requests (every /readyz poll)
    # would each start a build of their own, minutes of training and gigabytes apiece.
    with _BUILDING, _folder_locked(target.parent):
        if (target / "config.json").exists():
            return target
        return _build_into(target, build)


@contextlib.contextmanager
def _folder_locked(folder: Path) -> Iterator[None]:
    """An exclusive lock between processes on ``folder`` itself (no lock file is left)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _build_into(target: Path, build: Callable[[Path], object]) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{target.name}-", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise  # not a lost race: a real failure
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_builds(models_dir: Path, max_age_s: float = 3600.0) -> None:
    for path in models_dir.glob(".build-*"):
        try:
            if time.time() - path.stat().st_mtime > max_age_s:
                shutil.rmtree(path, ignore_errors=True)
        except FileNotFoundError:
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.demo_model",
                                     description="Build a small Llama checkpoint.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pooling", choices=("mean", "cls", "lasttoken"),
                        help="an embedding model in the sentence-transformers layout, pooled "
                             "so (normalised)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.pooling:
        path = build_embedding_model(args.out_dir, size=args.size, seed=args.seed,
                                     pooling=args.pooling)
    else:
        path = build_model(args.out_dir, size=args.size, seed=args.seed)
    print(f"built {args.size} model in {time.perf_counter() - started:.1f}s: {path}")


if __name__ == "__main__":
    main()
