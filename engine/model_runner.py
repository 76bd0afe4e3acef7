"""The model runner: owns the weights, the KV cache tensors, and every other tensor.

``run`` turns the scheduler's plain ``SchedulerOutput`` into input tensors, runs one
forward pass over all scheduled tokens, and samples a token for each request that
asked for one. It makes no scheduling decision.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from engine.batch import (
    PromptLogprob,
    RunnerOutput,
    SampleFailure,
    ScheduledRequest,
    SchedulerOutput,
)
from engine.config import EngineConfig
from engine.embedding import pool_rows
from engine.host_kv import SAVE
from engine.kernels.sgmv import Segments
from engine.layers.attention import AttentionMetadata, PrefillSpan
from engine.lora.adapter import LoRAAdapter
from engine.lora.manager import LoRABatch, LoRAManager
from engine.metrics import PhaseClock
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_weights
from engine.models.model_config import ModelConfig
from engine.sampler import NOT_FINITE, sample_batch
from engine.speculative import verify_row

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Prompt logprobs are computed this many positions at a time: their float32 log-softmax is
# [rows, vocab], 128 MiB here on a 128k vocabulary, where a whole chunk's could take GiBs.
PROMPT_LOGPROB_ROWS = 256


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, *,
                 enable_lora: bool = False, clock: PhaseClock | None = None,
                 generates: bool = True) -> None:
        """With ``enable_lora``, ``config.max_loras`` LoRA slots are allocated on the device.
        ``run`` laps ``clock`` (the engine's) at its inputs, forward pass and sampling.
        Without ``generates`` (an embedding model) it computes no logits, and holds no
        lm_head."""
        self.config = config
        self.clock = clock or PhaseClock()
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.block_size
        self.use_triton = (self.device.type == "cuda") if config.use_triton is None \
            else config.use_triton
        self.model = LlamaForCausalLM(model_config, max_positions=max_model_len,
                                      dtype=self.dtype, device=self.device,
                                      with_lm_head=generates)
        load_weights(self.model, config.model_dir)
        self.model.eval()
        self.vocab_size = model_config.vocab_size  # the logits' width
        self._grammar_thread: ThreadPoolExecutor | None = None  # fills grammar masks
        # Copies into the host tier of blocks the pool freed, beside a step's forward pass
        # (SchedulerOutput.host_ahead); the last step's, until the next step begins. On a GPU
        # the thread issues them on a stream of their own, so the bus moves them while the
        # default stream computes.
        self._copy_thread: ThreadPoolExecutor | None = None
        self._copying: Future[None] | None = None
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" \
            else None
        # Adapters copied into their slots beside a step (AdapterLifecycle stages them for
        # the requests next in the queue): (slot, adapter, its copy), until settled.
        self._adapter_thread: ThreadPoolExecutor | None = None
        self._adapter_copies: list[tuple[int, str, Future[None]]] = []
        self.lora = None if not enable_lora else LoRAManager(
            model_config, num_slots=config.max_loras, max_rank=config.max_lora_rank,
            dtype=self.dtype, device=self.device, use_triton=self.use_triton)
        self.num_blocks = self._num_kv_blocks(model_config)
        shape = (self.num_blocks, self.block_size, model_config.num_kv_heads,
                 model_config.head_dim)
        # One (K, V) pair per layer: [num_blocks, block_size, kv_heads, head_dim] each.
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(model_config.num_layers)]
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks,
                 self.block_size, self.num_blocks * self._block_bytes(model_config) / 2**20)
        # The prefix cache's host tier (engine/host_kv.py): the same layout, in host memory
        # (pinned on a GPU, so copies to and from it run at the bus's speed).
        self.num_host_blocks = config.kv_host_bytes // self._block_bytes(model_config)
        host = (self.num_host_blocks, *shape[1:])
        pinned = self.device.type == "cuda"
        self.host_caches = [(torch.zeros(host, dtype=self.dtype, pin_memory=pinned),
                             torch.zeros(host, dtype=self.dtype, pin_memory=pinned))
                            for _ in range(model_config.num_layers)] \
            if self.num_host_blocks else []

    def _block_bytes(self, cfg: ModelConfig) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * element

    def _num_kv_blocks(self, cfg: ModelConfig) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_bytes
        if self.device.type == "cuda":
            # After the weights, keep room for one step's activations (a generous estimate
            # at the token budget), then take the configured fraction of what is left.
            free, total = torch.cuda.mem_get_info(self.device)
            activations = self.config.max_num_batched_tokens * cfg.intermediate_size * 2 * 4 * 4
            used = total - free
            budget = int(total * self.config.gpu_memory_utilization) - used - activations
        blocks = budget // self._block_bytes(cfg)
        if blocks < 1:
            raise ValueError("no memory left for the KV cache; lower the model size or raise "
                             "the budget")
        return int(blocks)

    def adapter_in_slot(self, slot: int) -> str | None:
        """The adapter whose copy into ``slot`` completed; None after a failed copy."""
        return self.lora.slot_hash[slot]

    def copy_adapter(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copies an adapter's weights into a LoRA slot (which ones: AdapterLifecycle's call)."""
        self.settle_adapter_copies()  # a copy beside still writing this slot finishes first
        self.lora.load_slot(slot, adapter)

    def copy_adapter_beside(self, slot: int, adapter: LoRAAdapter) -> None:
        """Starts copying an adapter into a slot no row of the coming step uses, beside its
        forward pass (on a GPU on the copy stream); the slot names the adapter once
        ``settle_adapter_copies`` has seen the copy through."""
        self.lora.clear_slot(slot)
        if self._adapter_thread is None:
            self._adapter_thread = ThreadPoolExecutor(1, thread_name_prefix="adapter-copies")
        copying = self._adapter_thread.submit(self._write_adapter, slot, adapter,
                                              self._mark_default_stream())
        self._adapter_copies.append((slot, adapter.adapter_hash, copying))

    def _write_adapter(self, slot: int, adapter: LoRAAdapter,
                       mark: torch.cuda.Event | None) -> None:
        if self._copy_stream is None:
            self.lora.write_slot(slot, adapter)
            return
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(mark)
            self.lora.write_slot(slot, adapter)

    def settle_adapter_copies(self) -> None:
        """Waits for the adapter copies started beside earlier steps; each slot whose copy
        completed names its adapter (one that failed names none, and is copied again when a
        row needs it)."""
        copies, self._adapter_copies = self._adapter_copies, []
        for slot, adapter_hash, copying in copies:
            try:
                copying.result()
            except Exception:  # noqa: BLE001 - the slot stays empty; a row needing it recopies
                log.exception("copying adapter %s into slot %d failed", adapter_hash, slot)
                continue
            if self._copy_stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            self.lora.slot_hash[slot] = adapter_hash

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> RunnerOutput:
        """One forward pass; the sampled token of each request that samples, else None,
        and the logprobs of those that asked.

        A request whose row could not be sampled gets a ``SampleFailure``.
        """
        reqs = batch.requests
        # NOTE: fail closed: a copy lost or failed earlier must never run a row with another
        # adapter's weights (AdapterLifecycle.fill_slots copies them in before each step).
        for r in reqs:
            if r.adapter_slot >= 0 and self.lora.slot_hash[r.adapter_slot] != r.adapter_hash:
                raise RuntimeError(f"LoRA slot {r.adapter_slot} does not hold adapter "
                                   f"{r.adapter_hash} for request {r.request_id}")
        self.move_kv(batch)
        if not reqs:
            return RunnerOutput([])
        # Decode rows (one query token) first, then prompt chunks; within each, rows of one
        # adapter next to each other, so LoRA runs one segment per adapter.
        order = sorted(range(len(reqs)),
                       key=lambda i: (len(reqs[i].token_ids) > 1, reqs[i].adapter_slot))
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        num_decodes = 0
        last_row: dict[int, int] = {}  # request index -> its last row in the flat batch
        row_slots: list[int] = []  # LoRA slot of every row, -1 for the base model
        bs = self.block_size
        for i in order:
            req = reqs[i]
            n = len(req.token_ids)
            if n == 1:
                num_decodes += 1
            else:
                prefills.append(PrefillSpan(
                    token_start=len(token_ids), num_tokens=n, start_pos=req.start_pos,
                    block_table=torch.tensor(req.block_table, dtype=torch.int32,
                                             device=self.device)))
            token_ids.extend(req.token_ids)
            row_slots.extend([req.adapter_slot] * n)
            span = range(req.start_pos, req.start_pos + n)
            positions.extend(span)
            slots.extend(req.block_table[p // bs] * bs + p % bs for p in span)
            last_row[i] = len(token_ids) - 1
        decodes = [reqs[i] for i in order[:num_decodes]]
        width = max((len(r.block_table) for r in decodes), default=0)
        tables = [r.block_table + [0] * (width - len(r.block_table)) for r in decodes]
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decodes=num_decodes,
            decode_block_tables=torch.tensor(tables, dtype=torch.int32, device=device)
            .reshape(num_decodes, width),
            decode_context_lens=torch.tensor([r.start_pos + 1 for r in decodes],
                                             dtype=torch.int32, device=device),
            prefills=prefills, use_triton=self.use_triton)
        lora = None
        if any(slot >= 0 for slot in row_slots):
            lora = LoRABatch(self.lora, Segments.from_row_slots(row_slots, device))
        # NOTE: an embedding row is never sampled: no logits (lm_head) are computed for it.
        sampling = [i for i in range(len(reqs))
                    if reqs[i].sample and not reqs[i].draft and reqs[i].embedding is None]
        speculating = [i for i in range(len(reqs)) if reqs[i].draft]
        rows, source = _sampling_rows(reqs, sampling)
        masks = self._fill_masks(rows)
        inputs = torch.tensor(token_ids, device=device)
        position_ids = torch.tensor(positions, device=device)
        self.clock.lap("inputs")
        hidden = self.model(inputs, position_ids, self.kv_caches, meta, lora)
        self.clock.lap("forward")
        out = RunnerOutput([None] * len(reqs))
        if sampling:
            last = torch.tensor([last_row[i] for i in sampling], device=device)
            logits = self.model.compute_logits(hidden[last])  # [sampling rows, vocab]
            if len(rows) > len(sampling):
                logits = logits[torch.tensor(source, device=device)]  # [rows, vocab]
            out = _sample(logits, reqs, sampling, rows, masks.result() if masks else None)
        if speculating:
            self._verify(hidden, reqs, speculating, last_row, out)
        pool_rows(hidden, reqs, last_row, out.sampled)  # embedding inputs' rows
        out.prompt_logprobs = self._prompt_logprobs(hidden, reqs, last_row)
        self.clock.lap("sample")
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, reqs: list[ScheduledRequest],
                         last_row: dict[int, int]) -> dict[int, list[PromptLogprob]]:
        """For each row that asked, the logprobs of the prompt tokens its positions predict:
        at position p, prompt token p + 1's, from the raw logits (RunnerOutput.prompt_logprobs).

        NOTE: a row of one token (a 1-token chunk) can predict a prompt token too, so every
        row but a speculating one is looked at, not only prefill chunks.
        """
        spans: dict[int, range] = {}  # request index -> its rows in hidden that predict one
        for i, req in enumerate(reqs):
            count = min(len(req.token_ids), req.num_prompt_tokens - 1 - req.start_pos)
            if req.sampling.prompt_logprobs is not None and not req.draft and count > 0:
                first = last_row[i] - len(req.token_ids) + 1
                spans[i] = range(first, first + count)
        if not spans:
            return {}
        device = self.device
        rows = torch.tensor([r for span in spans.values() for r in span], device=device)
        targets = torch.tensor([reqs[i].history[reqs[i].start_pos + 1 + k]
                                for i, span in spans.items() for k in range(len(span))],
                               device=device)
        k = max(reqs[i].sampling.prompt_logprobs for i in spans)
        chosen, ranks, top_values, top_ids = [], [], [], []
        for start in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            part = slice(start, start + PROMPT_LOGPROB_ROWS)
            logits = self.model.compute_logits(hidden[rows[part]])  # [part, vocab] float32
            logprobs = torch.log_softmax(logits, dim=-1)
            target = logprobs.gather(1, targets[part, None])  # [part, 1]
            chosen.append(target[:, 0])
            ranks.append((logprobs > target).sum(dim=-1) + 1)
            top = torch.topk(logprobs, k, dim=-1)  # [part, k] each
            top_values.append(top.values)
            top_ids.append(top.indices)
        chosen_l, ranks_l = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
        values_l, ids_l = torch.cat(top_values).tolist(), torch.cat(top_ids).tolist()
        out: dict[int, list[PromptLogprob]] = {}
        r = 0  # the first of the request's rows in the lists
        for i, span in spans.items():
            width = reqs[i].sampling.prompt_logprobs
            out[i] = [PromptLogprob(chosen_l[j], ranks_l[j],
                                    list(zip(ids_l[j][:width], values_l[j][:width], strict=True)))
                      for j in range(r, r + len(span))]
            r += len(span)
        return out

    def _verify(self, hidden: torch.Tensor, reqs: list[ScheduledRequest], rows: list[int],
                last_row: dict[int, int], out: RunnerOutput) -> None:
        """Each speculating row's tokens (engine/speculative.py), from its logits at the
        last token and at each draft token."""
        spans = [range(last_row[i] - len(reqs[i].draft), last_row[i] + 1) for i in rows]
        index = torch.tensor([r for span in spans for r in span], device=self.device)
        logits = self.model.compute_logits(hidden[index])  # [sum of draft + 1, vocab]
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        start = 0
        for i, span in zip(rows, spans, strict=True):
            stop = start + len(span)
            if not all(finite[start:stop]):
                out.sampled[i] = SampleFailure(NOT_FINITE)
            else:
                out.speculated[i] = verify_row(logits[start:stop], reqs[i])
                out.sampled[i] = out.speculated[i].tokens[0]
            start = stop

    def _fill_masks(self, rows: list[ScheduledRequest]) -> Future | None:
        """Starts filling the constrained rows' grammar masks on a thread, to overlap the
        forward pass (xgrammar releases the GIL while it fills)."""
        states = [r.grammar for r in rows]
        if all(state is None for state in states):
            return None
        from engine.grammar import fill_bitmasks  # NOTE: xgrammar loads on first use only

        if self._grammar_thread is None:
            self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._grammar_thread.submit(fill_bitmasks, states, self.vocab_size)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each destination block gets its source's keys and values."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:  # [num_blocks, block_size, kv_heads, head_dim]
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def move_kv(self, batch: SchedulerOutput) -> None:
        """The copies of KV blocks a step's scheduling decided: the last step's copies ahead
        finished, this step's host moves and copy-on-write made, then its copies ahead
        started beside the forward pass. A step that runs no request makes them too: the
        host tier counts on each one it decided."""
        self._settle_host_copies()
        if batch.host_moves:
            self._move_host(batch.host_moves)
            self.clock.lap("kv_host")
        if batch.block_copies:
            self._copy_blocks(batch.block_copies)
        if batch.host_ahead:
            if self._copy_thread is None:
                self._copy_thread = ThreadPoolExecutor(1, thread_name_prefix="kv-host-copies")
            self._copying = self._copy_thread.submit(self._move_host_beside, batch.host_ahead,
                                                     self._mark_default_stream())

    def _mark_default_stream(self) -> torch.cuda.Event | None:
        """On a GPU, the point the copies ahead start from: what the default stream has
        been given so far (the blocks they save were written there), not the forward pass
        queued after it."""
        if self._copy_stream is None:
            return None
        mark = torch.cuda.Event()
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def _move_host_beside(self, moves: list[tuple[str, int, int]],
                          mark: torch.cuda.Event | None) -> None:
        if self._copy_stream is None:  # the CPU: the thread is what runs them beside
            self._move_host(moves)
            return
        # NOTE: a stream set in a thread is that thread's only; a save's copy to the host
        # waits for this stream alone.
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(mark)
            self._move_host(moves)

    def _settle_host_copies(self) -> None:
        """Waits for the copies ahead that the last step started: a block they read may be
        handed out and written from this step on, a slot they write may be read or given to
        another block, a block they restore is read by this step. On a GPU, the default
        stream's work from here on waits for theirs too."""
        if self._copying is not None:
            copying, self._copying = self._copying, None
            copying.result()
            if self._copy_stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            self.clock.lap("kv_host_wait")

    def _move_host(self, moves: list[tuple[str, int, int]]) -> None:
        """The host tier's saves and loads, in order: each run of one kind at once, every
        layer (a run is cut where a destination repeats: the later copy must win)."""
        for kind, src, dst in _runs(moves):
            source = torch.tensor(src, device=self.device if kind == SAVE else "cpu")
            target = torch.tensor(dst, device="cpu" if kind == SAVE else self.device)
            for pool, host in zip(self.kv_caches, self.host_caches, strict=True):
                for device_cache, host_cache in zip(pool, host, strict=True):
                    if kind == SAVE:
                        host_cache[target] = device_cache[source].to("cpu")
                    else:
                        device_cache[target] = host_cache[source].to(self.device,
                                                                     non_blocking=True)


def _runs(moves: list[tuple[str, int, int]]) -> list[tuple[str, list[int], list[int]]]:
    runs: list[tuple[str, list[int], list[int]]] = []
    targets: set[int] = set()
    for kind, src, dst in moves:
        if not runs or runs[-1][0] != kind or dst in targets:
            runs.append((kind, [], []))
            targets = set()
        runs[-1][1].append(src)
        runs[-1][2].append(dst)
        targets.add(dst)
    return runs


def _sampling_rows(reqs: list[ScheduledRequest], sampling: list[int]
                   ) -> tuple[list[ScheduledRequest], list[int]]:
    """The rows sampled this step: ``reqs[i]`` for ``i`` in ``sampling``, then the first
    token of every choice a request forks; and which logits row each reads."""
    rows, source = [reqs[i] for i in sampling], list(range(len(sampling)))
    for k, i in enumerate(sampling):
        req = reqs[i]
        grammars = req.fork_grammars or [None] * len(req.fork_seeds)
        for seed, grammar in zip(req.fork_seeds, grammars, strict=True):
            rows.append(replace(req, seed=seed, grammar=grammar, fork_seeds=[], fork_grammars=[]))
            source.append(k)
    return rows, source


def _sample(logits: torch.Tensor, reqs: list[ScheduledRequest], sampling: list[int],
            rows: list[ScheduledRequest], masks: Any) -> RunnerOutput:
    """Samples ``rows`` (``_sampling_rows``) from ``logits`` [len(rows), vocab], with the
    grammar masks filled for them."""
    tokens, logprobs = sample_batch(logits, rows, masks=masks)
    # The raw logprob of each sampled token, for the choice's cumulative logprob.
    summed = [j for j, r in enumerate(rows) if r.sampled_logprob and isinstance(tokens[j], int)]
    chosen: list[float | None] = [None] * len(rows)
    if summed:
        index = torch.tensor(summed, device=logits.device)
        ids = torch.tensor([tokens[j] for j in summed], device=logits.device)
        values = torch.log_softmax(logits[index].float(), dim=-1)  # [summed, vocab]
        for j, value in zip(summed, values.gather(1, ids[:, None])[:, 0].tolist(), strict=True):
            chosen[j] = value
    size, m = len(reqs), len(sampling)
    out = RunnerOutput(_spread(tokens[:m], sampling, size) or [None] * size,
                       _spread(logprobs[:m], sampling, size), _spread(chosen[:m], sampling, size))
    start = m  # the forks' rows follow, request by request
    for i in sampling:
        stop = start + len(reqs[i].fork_seeds)
        if stop > start:
            out.forks[i] = RunnerOutput(tokens[start:stop], _present(logprobs[start:stop]),
                                        _present(chosen[start:stop]))
        start = stop
    return out


def _present(values: list[Any]) -> list[Any]:
    """``values``, or [] when every one is None (RunnerOutput's "none asked for")."""
    return values if any(v is not None for v in values) else []


def _spread(values: list[Any], at: Sequence[int], size: int) -> list[Any]:
    """``values[k]`` at position ``at[k]`` of a list of ``size``, None elsewhere; [] when
    every value is None."""
    if not _present(values):
        return []
    out = [None] * size
    for k, value in zip(at, values, strict=True):
        out[k] = value
    return out
