"""Attention over the paged KV cache: write this step's keys and values, then attend.

The KV cache of one layer is two tensors [num_blocks, block_size, kv_heads, head_dim];
a sequence's block table lists the blocks that hold its positions in order. Decode
rows (one query token) run batched, on the Triton kernel on CUDA or the torch path
elsewhere; prompt chunks run one sequence at a time through SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.paged_attention import (
    DecodePlan,
    gather_blocks,
    paged_decode_attention,
    paged_decode_reference,
)


@dataclass(slots=True)
class PrefillSpan:
    token_start: int  # first row of this chunk in the step's flattened tokens
    num_tokens: int
    start_pos: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # [blocks] int32


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64: cache slot (block * block_size + offset)
    num_decodes: int  # the first num_decodes rows are one-token queries
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] int32: tokens to attend, incl. the new
    prefills: list[PrefillSpan]
    use_triton: bool = False
    decode_plan: DecodePlan | None = None  # the torch path's, made by the first layer


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores k, v [tokens, kv_heads, head_dim] at their slots."""
    kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [tokens, heads, head_dim], k/v [tokens, kv_heads, head_dim] -> like q."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    d = meta.num_decodes
    if d and meta.use_triton:
        out[:d] = paged_decode_attention(q[:d], k_cache, v_cache, meta.decode_block_tables,
                                         meta.decode_context_lens, scale)
    elif d:
        if meta.decode_plan is None:
            meta.decode_plan = DecodePlan(meta.decode_block_tables, meta.decode_context_lens,
                                          k_cache.shape[1])
        out[:d] = paged_decode_reference(q[:d], k_cache, v_cache, meta.decode_block_tables,
                                         meta.decode_context_lens, scale,
                                         plan=meta.decode_plan)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        out[rows] = _prefill_one(q[rows], k[rows], v[rows], k_cache, v_cache, span, scale)
    return out


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, span: PrefillSpan, scale: float) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[1]
    if span.start_pos == 0:  # nothing cached before this chunk: its own keys suffice
        mask, causal = None, True
    else:
        context = span.start_pos + span.num_tokens
        k = gather_context(k_cache, span.block_table, context)  # [context, kv_heads, head_dim]
        v = gather_context(v_cache, span.block_table, context)
        query_pos = torch.arange(span.start_pos, context, device=q.device)
        mask = torch.arange(context, device=q.device)[None, :] <= query_pos[:, None]
        causal = False
    # NOTE: 4-D inputs (a batch of one): given 3-D ones, SDPA on CPU leaves its fused
    # kernel for the reference math, three to five times slower on a 512-token chunk.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.to(q.dtype).transpose(0, 1)[None],
        v.to(q.dtype).transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=heads != kv_heads)
    return out[0].transpose(0, 1)  # [chunk, heads, head_dim]


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence: [length, kv_heads, head_dim]."""
    return gather_blocks(cache, block_table[None, :])[0, :length]
