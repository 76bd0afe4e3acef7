"""Engine configuration: one dataclass, validated on creation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.speculative import parse_mode


@dataclass(slots=True)
class EngineConfig:
    model_dir: Path
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    block_size: int = 16  # tokens per KV block
    # KV cache size: an explicit block count wins; else a byte budget (CPU) or a
    # fraction of free GPU memory after the weights are loaded (CUDA).
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 512 * 1024 * 1024
    gpu_memory_utilization: float = 0.9
    # The prefix cache's host tier: blocks the pool evicts are kept in this much host memory
    # and loaded back instead of recomputed (engine/host_kv.py); 0: none.
    kv_host_bytes: int = 0
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 512  # tokens per step (decodes + prefill chunks)
    # Requests held waiting in the engine at most; the rest stay in the Redis streams, where
    # an idle peer may take them (engine/streams.py). The scheduler is fair across tenants
    # among those it holds.
    max_waiting: int = 32
    # Seats (of max_num_seqs) only the priority tier may take (engine/tiers.py).
    priority_reserve_seats: int = 0
    # What tenants are made even in: "tokens" of service, or "requests" (engine/fair_share.py).
    fair_share: str = "tokens"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    use_triton: bool | None = None  # None: Triton kernels on CUDA, torch paths elsewhere
    # LoRA: served only with an adapter store (engine/lora/store.py).
    adapter_store: Path | None = None
    max_loras: int = 8  # adapter slots on the device: distinct adapters in one batch
    max_lora_rank: int = 64
    max_cpu_loras: int = 64  # adapters kept in host memory (beyond those in use)
    pinned_adapters: tuple[str, ...] = ()  # content hashes loaded at start, never evicted
    # Where to download adapters the store lacks (the platform's /internal/adapters/).
    adapter_fetch_url: str = ""
    engine_token: str = ""
    # Speculative decoding (engine/speculative.py): "off", "ngram" or "draft:PATH" (a
    # smaller checkpoint with this model's tokenizer, engine/draft_model.py); the most draft tokens
    # a sequence verifies in a step; no sequence speculates while more decode at once.
    speculative: str = "off"
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 4
    # A generative checkpoint answers embed requests too (last-token pooling, normalised:
    # engine/pooling.py); a sentence-transformers checkpoint answers them whatever this says.
    embeddings: bool = False

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_bytes < 1 or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("kv_cache_bytes must be > 0 and gpu_memory_utilization in (0, 1]")
        if self.kv_host_bytes < 0:
            raise ValueError("kv_host_bytes must be >= 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_waiting < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_waiting must be >= 1")
        self._check_scheduling()
        if self.adapter_store is not None:
            self.adapter_store = Path(self.adapter_store)
        if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 512 or self.max_cpu_loras < 1:
            raise ValueError("max_loras and max_cpu_loras must be >= 1, max_lora_rank in [1, 512]")
        if len(self.pinned_adapters) > self.max_loras:
            raise ValueError("more pinned adapters than LoRA slots")
        self.speculative = parse_mode(self.speculative)
        if not 1 <= self.num_speculative_tokens <= 16 or self.speculative_max_batch < 1:
            raise ValueError("num_speculative_tokens must be in [1, 16], speculative_max_batch "
                             ">= 1")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must cover "
                             "max_model_len")


    def _check_scheduling(self) -> None:
        """Tiers and fairness (engine/tiers.py, engine/fair_share.py)."""
        if self.fair_share not in ("tokens", "requests"):
            raise ValueError(f"fair_share must be tokens or requests, got {self.fair_share!r}")
        if not 0 <= self.priority_reserve_seats < self.max_num_seqs:
            raise ValueError("priority_reserve_seats must be >= 0 and below max_num_seqs")


def eos_token_ids(model_dir: Path) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json (an int or a list in either)."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return frozenset([value] if isinstance(value, int) else value)
    return frozenset()
