"""The engine's command-line flags and the engine they build, shared by ``python -m
engine.worker`` and ``atrium engine`` (each flag's default: an ATRIUM_* variable)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path

from engine.outputs import EngineCore

log = logging.getLogger(__name__)

EngineFactory = Callable[[Path], EngineCore]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by ``python -m engine.worker`` and ``atrium engine``."""
    env = os.environ.get
    parser.add_argument("--engine", choices=("paged", "reference"),
                        default=env("ATRIUM_ENGINE", "paged"),
                        help="paged: continuous batching (default); reference: transformers, "
                             "one request at a time")
    parser.add_argument("--device", default=env("ATRIUM_DEVICE"),
                        help="cpu or cuda[:N] (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        default=env("ATRIUM_DTYPE"),
                        help="default: float32 on CPU, the checkpoint's dtype on CUDA")
    parser.add_argument("--block-size", type=int, default=int(env("ATRIUM_BLOCK_SIZE", "16")))
    parser.add_argument("--kv-cache-mib", type=int, default=int(env("ATRIUM_KV_CACHE_MIB", "512")),
                        help="KV cache size on CPU (on CUDA: --gpu-memory-utilization)")
    parser.add_argument("--kv-host-mib", type=int, default=int(env("ATRIUM_KV_HOST_MIB", "0")),
                        help="host memory that keeps KV blocks evicted from the cache, "
                             "loaded back instead of recomputed (0: none)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=float(env("ATRIUM_GPU_MEMORY_UTILIZATION", "0.9")))
    parser.add_argument("--max-num-seqs", type=int, default=int(env("ATRIUM_MAX_NUM_SEQS", "64")))
    parser.add_argument("--max-waiting", type=int, default=int(env("ATRIUM_MAX_WAITING", "32")),
                        help="requests held waiting here at most; the rest wait in Redis, "
                             "where an idle engine of the model may take them")
    parser.add_argument("--priority-reserve-seats", type=int,
                        default=int(env("ATRIUM_PRIORITY_RESERVE_SEATS", "0")),
                        help="seats of --max-num-seqs only service_tier=priority requests take")
    parser.add_argument("--fair-share", choices=("tokens", "requests"),
                        default=env("ATRIUM_FAIR_SHARE", "tokens"),
                        help="what tenants are made even in under load: tokens of service "
                             "(token-fair), or requests (tenants take turns by request)")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=int(env("ATRIUM_MAX_NUM_BATCHED_TOKENS", "512")))
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--adapter-store", default=env("ATRIUM_ADAPTER_STORE"),
                        help="folder of PEFT adapters by content hash (engine/lora/store.py); "
                             "LoRA is served only with one")
    parser.add_argument("--adapter-fetch-url", default=env("ATRIUM_ADAPTER_FETCH_URL", ""),
                        help="download adapters the store lacks from the platform, e.g. "
                             "http://web:8000/internal/adapters (token: ATRIUM_ENGINE_TOKEN)")
    parser.add_argument("--max-loras", type=int, default=int(env("ATRIUM_MAX_LORAS", "8")),
                        help="adapter slots on the device")
    parser.add_argument("--max-lora-rank", type=int,
                        default=int(env("ATRIUM_MAX_LORA_RANK", "64")))
    parser.add_argument("--max-cpu-loras", type=int,
                        default=int(env("ATRIUM_MAX_CPU_LORAS", "64")))
    parser.add_argument("--pin-adapter", action="append", default=[], metavar="HASH",
                        help="keep this adapter in a slot from start-up (repeatable)")
    parser.add_argument("--speculative", default=env("ATRIUM_SPECULATIVE", "ngram"),
                        help="speculative decoding: off, ngram (prompt lookup) or "
                             "draft:PATH (a smaller checkpoint with this model's tokenizer; "
                             "docs/speculative.md)")
    parser.add_argument("--num-speculative-tokens", type=int,
                        default=int(env("ATRIUM_SPECULATIVE_TOKENS", "4")),
                        help="the most draft tokens a sequence verifies in a step")
    parser.add_argument("--speculative-max-batch", type=int,
                        default=int(env("ATRIUM_SPECULATIVE_MAX_BATCH", "4")),
                        help="no sequence speculates while more than this many decode")
    parser.add_argument("--embeddings", action="store_true",
                        default=env("ATRIUM_ENGINE_EMBEDDINGS", "").lower() in ("1", "true"),
                        help="a generative model answers embed requests too: the last "
                             "token's final hidden state, normalised (default: "
                             "ATRIUM_ENGINE_EMBEDDINGS=1); a sentence-transformers "
                             "checkpoint serves embeddings only, whatever this says")
    parser.add_argument("--threads", type=int, default=int(env("ATRIUM_ENGINE_THREADS") or "0"),
                        help="on CPU, the threads of this engine's forward passes (default: "
                             "ATRIUM_ENGINE_THREADS, or 0: torch's, one a core); engines "
                             "sharing a host's cores should split them (`atrium up` does)")
    parser.add_argument("--drain-seconds", type=float,
                        default=float(env("ATRIUM_DRAIN_S", "30")),
                        help="on SIGTERM: take nothing new and finish what is held for up to "
                             "this long, then stop (docs/deploy.md)")
    add_metrics_arguments(parser, "ATRIUM_METRICS_PORT")


def add_metrics_arguments(parser: argparse.ArgumentParser, port_variable: str) -> None:
    """``--metrics-port`` (default: ``port_variable``, or 0: off) and ``--metrics-host``:
    every process's Prometheus endpoint is set the same way (docs/observability.md)."""
    env = os.environ.get
    parser.add_argument("--metrics-port", type=int, default=int(env(port_variable) or "0"),
                        help=f"serve Prometheus metrics on this port (default: "
                             f"{port_variable}, or 0: off)")
    parser.add_argument("--metrics-host", default=env("ATRIUM_METRICS_HOST") or "127.0.0.1",
                        help="address the metrics endpoint listens on (default: "
                             "ATRIUM_METRICS_HOST or loopback only; 0.0.0.0 for a scraper "
                             "on another host)")


def threads_each(engines: int) -> int:
    """Torch threads for each of ``engines`` engines started on this host's cores (0: torch's
    default, for one): each keeps a share of the cores, since the threads of one engine's
    step wait for each other whenever another process holds a core they need (measured in
    docs/benchmarks.md, embeddings)."""
    return 0 if engines <= 1 else max(1, len(os.sched_getaffinity(0)) // engines)


def engine_factory_from_args(args: argparse.Namespace) -> EngineFactory:
    def factory(model_dir: Path) -> EngineCore:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu":
            if args.threads:
                torch.set_num_threads(args.threads)
            log.info("engine on cpu with %d torch threads", torch.get_num_threads())
        if args.engine == "reference":
            from engine.reference import ReferenceEngine

            return ReferenceEngine(model_dir, device=device)
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        from engine.models.model_config import ModelConfig

        dtype = args.dtype
        if dtype is None:
            own = ModelConfig.from_dir(model_dir).dtype
            dtype = own if device.startswith("cuda") and own in ("bfloat16", "float16") \
                else "float32"
        return LLMEngine(EngineConfig(
            model_dir=model_dir, device=device, dtype=dtype, block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_mib * 2**20, kv_host_bytes=args.kv_host_mib * 2**20,
            gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
            max_waiting=args.max_waiting, priority_reserve_seats=args.priority_reserve_seats,
            fair_share=args.fair_share,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            adapter_store=Path(args.adapter_store) if args.adapter_store else None,
            max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras, pinned_adapters=tuple(args.pin_adapter),
            adapter_fetch_url=args.adapter_fetch_url,
            engine_token=os.environ.get("ATRIUM_ENGINE_TOKEN", ""),
            speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
            speculative_max_batch=args.speculative_max_batch, embeddings=args.embeddings))

    return factory


def default_engine_factory(model_dir: Path) -> EngineCore:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_factory_from_args(parser.parse_args([]))(model_dir)
