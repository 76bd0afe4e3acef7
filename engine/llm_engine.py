"""The continuous-batching engine: the loop a newcomer reads first.

    step():  schedule (who runs, how many tokens) -> run (one forward pass) -> postprocess

``add_request`` checks a request and queues it; ``abort_request`` ends one at once.
The worker (worker.py) drives this through the ``EngineCore`` interface.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from engine import parallel, protocol
from engine.config import EngineConfig, eos_token_ids
from engine.detokenizer import IncrementalDetokenizer
from engine.embedding import settle, start_inputs
from engine.kv_cache_manager import KVCacheManager
from engine.lora.lifecycle import AdapterLifecycle
from engine.lora.store import AdapterStore
from engine.metrics import EngineMetrics
from engine.model_runner import DTYPES, ModelRunner
from engine.models.model_config import ModelConfig
from engine.outputs import RequestOutput
from engine.parallel import usage_of
from engine.pooling import GENERATIVE, read_max_seq_length, read_pooling
from engine.prefix_hash import PrefixSummary, cache_scope
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.speculative import SpeculationGovernor

if TYPE_CHECKING:
    from engine.batch import RunnerOutput, SchedulerOutput
    from engine.draft_model import DraftModel
    from engine.grammar import Grammars

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        # Embeddings (engine/pooling.py): a sentence-transformers checkpoint serves only them,
        # a generative one too when the operator turned them on.
        declared = read_pooling(config.model_dir)
        self.generates = declared is None and self.model_config.has_lm_head
        self.pooling = declared or (GENERATIVE if config.embeddings else None)
        if not self.generates and self.pooling is None:
            raise ValueError(f"{config.model_dir} has no language-model head: it can only "
                             f"embed, and embeddings are off (--embeddings)")
        self._embedding: dict[str, list[Sequence]] = {}  # open embed requests' inputs
        limit = self.model_config.max_position_embeddings
        if (longest_input := read_max_seq_length(config.model_dir)) is not None:
            limit = min(limit, longest_input)  # a sentence-transformers model's own cap
        self.max_model_len = min(config.max_model_len or limit, limit)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must cover the "
                             f"context ({self.max_model_len} tokens)")
        self.vocab_size = self.model_config.vocab_size
        self.tokenizer = Tokenizer.from_file(str(config.model_dir / "tokenizer.json"))
        self.eos_token_ids = eos_token_ids(config.model_dir)
        # LoRA: one component owns an adapter's life here (engine/lora/lifecycle.py): loads
        # into host memory in the background, device slots, pins, holds and releases.
        self.adapters: AdapterLifecycle | None = None
        slots = None
        if config.adapter_store is not None:
            self.adapters = AdapterLifecycle(
                AdapterStore(config.adapter_store, fetch_url=config.adapter_fetch_url,
                             token=config.engine_token), self.model_config,
                max_rank=config.max_lora_rank, dtype=DTYPES[config.dtype],
                host_capacity=config.max_cpu_loras, num_slots=config.max_loras,
                pinned=config.pinned_adapters)
            slots = self.adapters.slots
        self.metrics = EngineMetrics()
        self.runner = ModelRunner(config, self.model_config, self.max_model_len,
                                  enable_lora=self.adapters is not None,
                                  clock=self.metrics.clock, generates=self.generates)
        if self.adapters is not None:
            self.adapters.start(self.runner)  # the pinned ones, before any request
        self.kv = KVCacheManager(num_blocks=self.runner.num_blocks, block_size=config.block_size,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 host_blocks=self.runner.num_host_blocks)
        # Structured output: the compiler is set up on its own thread at start, grammars
        # compile on another; a sequence waits in _compiling until its grammar is ready.
        self._grammars: Grammars | None = None
        self._grammars_setup = threading.Thread(target=self._set_up_grammars,
                                                name="grammar-setup", daemon=True)
        if self.generates:  # an embedding model constrains no output
            self._grammars_setup.start()
        self._compiling: dict[str, tuple[Sequence, Future]] = {}
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
            enable_chunked_prefill=config.enable_chunked_prefill, metrics=self.metrics,
            slots=slots, speculative_tokens=config.num_speculative_tokens
            if config.speculative != "off" else 0,
            speculative_max_batch=config.speculative_max_batch,
            reserve_seats=config.priority_reserve_seats, fair_share=config.fair_share)
        self.governor = SpeculationGovernor() if config.speculative != "off" else None
        self.drafter: DraftModel | None = None
        if config.speculative.startswith("draft:"):
            from engine.draft_model import DraftModel

            self.drafter = DraftModel(
                config, Path(config.speculative.removeprefix("draft:")).expanduser(),
                target=self.model_config, target_dir=config.model_dir,
                target_blocks=self.runner.num_blocks, max_model_len=self.max_model_len)

    # -- EngineCore -----------------------------------------------------------------------

    def add_request(self, request: protocol.EngineRequest) -> None:
        if request.task == protocol.TASK_EMBED:
            self._add_embed_request(request)
            return
        if not self.generates:
            raise ValueError(f"model {request.model} serves embeddings only")
        params = SamplingParams.from_spec(request.sampling)
        params.min_tokens_masked = frozenset(self.eos_token_ids | set(params.stop_token_ids))
        prompt, extra = request.prompt_token_ids, request.extra_prompts
        self._check_prompts([prompt, *extra], params)
        adapter_hash = request.adapter_hash
        if adapter_hash is not None:
            self._check_adapter(request)
        self._check_id(request.request_id, (1 + len(extra)) * params.n)
        seq = Sequence(
            request_id=request.request_id, token_ids=list(prompt), num_prompt_tokens=len(prompt),
            params=params, seed=params.seed if params.seed is not None else secrets.randbits(63),
            tenant_id=request.tenant_id, **_service(request),
            cache_scope=cache_scope(request.tenant_id, request.cache_salt,
                                    adapter_hash or request.adapter),
            deadline=request.deadline, adapter_hash=adapter_hash,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop))
        if (1 + len(extra)) * params.n > 1:
            parallel.start_group(seq, params.n, extra)
        if request.sampling.grammar is not None:
            self._compiling[seq.request_id] = (seq, self.grammars().submit(
                request.sampling.grammar, tenant=request.tenant_id))
        else:
            self._enqueue(seq)

    def _add_embed_request(self, request: protocol.EngineRequest) -> None:
        """Queues an embed request: a sequence per input (engine/embedding.py)."""
        if self.pooling is None:
            raise ValueError(f"model {request.model} does not serve embeddings")
        inputs, most = [request.prompt_token_ids, *request.extra_prompts], \
            1 + protocol.max_extra_prompts(request.task)
        if len(inputs) > most:
            raise ValueError(f"{len(inputs)} inputs exceed the {most} an embed request may have")
        for i, tokens in enumerate(inputs):
            self._check_prompt(tokens, f"input {i}" if len(inputs) > 1 else "the input", 0)
        if request.adapter_hash is not None:
            self._check_adapter(request)
        self._check_id(request.request_id, len(inputs))
        # NOTE: the sampling spec is not read: an input samples nothing.
        seq = Sequence(
            request_id=request.request_id, token_ids=list(inputs[0]),
            num_prompt_tokens=len(inputs[0]), params=SamplingParams(max_tokens=1), seed=0,
            tenant_id=request.tenant_id, **_service(request),
            cache_scope=cache_scope(request.tenant_id, request.cache_salt,
                                    request.adapter_hash or request.adapter),
            deadline=request.deadline, adapter_hash=request.adapter_hash)
        members = start_inputs(seq, inputs[1:], self.pooling)
        self._enqueue(seq)
        self._embedding[request.request_id] = members

    def _enqueue(self, seq: Sequence) -> None:
        # A sequence whose adapter is still loading joins the queue once it is in host memory
        # (_admit_loaded).
        if seq.adapter_hash is None or self.adapters.hold(seq):
            self.scheduler.add(seq)

    def _check_id(self, request_id: str, num_choices: int) -> None:
        """Refuses (ValueError) a request id in use here, its choices' ids included."""
        taken = [request_id] + [parallel.choice_id(request_id, i) for i in range(1, num_choices)]
        if any(self._holds(rid) for rid in taken):
            raise ValueError(f"request {request_id} is already in the engine")
        base, sep, _ = request_id.rpartition("#")
        if sep and self._holds(base):
            raise ValueError(f"request id {request_id} may name a choice of request {base}, "
                             f"which is in the engine")

    def _holds(self, request_id: str) -> bool:
        return request_id in self.scheduler.sequences or request_id in self.scheduler.groups \
            or request_id in self._compiling or (
                self.adapters is not None and self.adapters.holds_request(request_id))

    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Refuses (ValueError) a request with more choices than allowed, or with a prompt
        this engine could never run."""
        if len(prompts) > 1 + protocol.max_extra_prompts(protocol.TASK_GENERATE):
            raise ValueError(f"{len(prompts)} prompts exceed the "
                             f"{1 + protocol.MAX_EXTRA_PROMPTS} a request may have")
        if len(prompts) * params.n > protocol.MAX_CHOICES:
            raise ValueError(f"{len(prompts)} prompts with n={params.n} make "
                             f"{len(prompts) * params.n} choices; a request may have at most "
                             f"{protocol.MAX_CHOICES}")
        # NOTE: a prompt's n choices start running together; different prompts need not.
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} choices exceed the {self.config.max_num_seqs} "
                             f"sequences this engine runs at once")
        for p, prompt in enumerate(prompts):
            self._check_prompt(prompt, f"prompt {p}" if len(prompts) > 1 else "the prompt",
                               params.max_tokens)

    def _check_prompt(self, prompt: list[int], what: str, max_tokens: int) -> None:
        """Refuses (ValueError) a prompt (``what``) this engine could never run with up to
        ``max_tokens`` of output (0: an embedding input, which has none)."""
        if not isinstance(prompt, list):
            raise ValueError(f"{what} must be an array of token ids")
        if not prompt:
            raise ValueError(f"{what} is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                   for t in prompt):
            raise ValueError(f"{what}'s token ids must be integers in [0, {self.vocab_size})")
        if len(prompt) + min(max_tokens, 1) > self.max_model_len:
            output = " including the output" if max_tokens else ""
            raise ValueError(f"{what} has {len(prompt)} tokens; this model's context holds "
                             f"{self.max_model_len}{output}")
        longest = min(len(prompt) + max_tokens, self.max_model_len)
        if self.kv.blocks_needed(longest) > self.kv.num_blocks:
            # NOTE: refused up front: a sequence that cannot fit alone would preempt itself
            # forever once it grew past the pool.
            raise ValueError(f"{what} and its output, {longest} tokens, need more KV cache "
                             f"than this engine has ({self.kv.num_blocks * self.kv.block_size} "
                             f"tokens)")

    def _check_adapter(self, request: protocol.EngineRequest) -> None:
        """Refuses (ValueError) an adapter this engine could never apply."""
        if self.adapters is None:
            raise ValueError("this engine serves no LoRA adapters")
        self.adapters.check(request.adapter_hash, request.adapter)

    def abort_request(self, request_id: str, reason: str) -> RequestOutput | None:
        if request_id in self._compiling:
            seq, compiling = self._compiling.pop(request_id)
            self.grammars().abandon(compiling)
            return RequestOutput(request_id, finished=True, finish_reason=reason,
                                 usage=usage_of(seq), choices=parallel.choices_of(seq, reason))
        loading = self.adapters.abort(request_id, reason) if self.adapters else None
        if loading is not None:
            return self._settle([loading])[0]
        return self._settle([self.scheduler.abort(request_id, reason)])[0]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._num_loading() > 0

    def _num_loading(self) -> int:
        """Sequences not yet queued: their grammar compiling or their adapter loading."""
        return len(self._compiling) + (self.adapters.num_loading if self.adapters else 0)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self._num_loading()

    def room(self) -> int:
        """How many more placed requests the worker may hand over now (lane_room: a lane's)."""
        held = self.num_waiting() - sum(self._lane_waiting(lane) for lane in protocol.LANES)
        return max(0, self.config.max_waiting - held)

    def lane_room(self, lane: str) -> int:
        """How many more requests of ``lane`` (protocol.LANES) the worker may hand over."""
        return max(0, self.config.max_waiting - self._lane_waiting(lane))

    def _lane_waiting(self, lane: str) -> int:
        return self.scheduler.waiting.num_in(protocol.tiers_of_lane(lane))

    def step(self) -> list[RequestOutput]:
        clock = self.metrics.clock
        clock.start()
        outputs = self._admit_compiled() + self._admit_loaded() + self.scheduler.expire()
        began = time.perf_counter()
        if self.governor is not None:
            self.scheduler.speculation_paused = not self.governor.wants_drafts()
        clock.lap("admit")
        if self.drafter is not None and (wanted := self.scheduler.draft_wanted()):
            self.scheduler.drafted = self.drafter.propose(wanted)
            clock.lap("draft")
        batch = self.scheduler.schedule()
        clock.lap("schedule")
        if not batch.requests:
            self._keep_accepted_drafts(None, None)
            try:  # what its scheduling decided still happens
                self.runner.move_kv(batch)
            except Exception:  # noqa: BLE001 - as a failed forward pass: neither tier trusted
                log.exception("copying KV blocks failed")
                self.kv.reset_cache()
            return self._settle(outputs)
        try:
            if self.adapters is not None:
                self.adapters.fill_slots(self.runner, batch.requests, self.scheduler.waiting)
                clock.lap("adapters")
            sampled = self.runner.run(batch)  # laps inputs, forward, sample
        except Exception as exc:  # noqa: BLE001 - fail this batch, keep serving the rest
            self._keep_accepted_drafts(None, None)
            log.exception("a forward pass failed; failing its %d requests", len(batch.requests))
            message = f"{type(exc).__name__}: {exc}"[:500]
            # NOTE: blocks indexed this step were never (fully) written: drop the whole index.
            self.kv.reset_cache()
            failed = [self.scheduler.abort(r.request_id, None, error=message)
                      for r in batch.requests]  # None for a request another row ended
            return self._settle(outputs + [out for out in failed if out is not None])
        self.metrics.record_step(
            prompt_tokens=sum(len(r.token_ids) for r in batch.requests
                              if not r.is_decode and not r.draft),
            generation_tokens=sampled.num_sampled)
        due = self._keep_prompt_logprobs(batch, sampled)  # before postprocess ends any
        produced = self.scheduler.postprocess(batch, sampled)
        _send_prompt_logprobs(due, produced)
        outputs += produced
        self._keep_accepted_drafts(batch, sampled)
        clock.lap("postprocess")
        rows = batch.requests
        if self.governor is not None and len(rows) <= self.config.speculative_max_batch \
                and all(r.is_decode or r.draft for r in rows):
            self.governor.record(drafting=any(r.draft for r in rows), rows=len(rows),
                                 tokens=sampled.num_sampled,
                                 seconds=time.perf_counter() - began)
        return self._settle(outputs)

    def _keep_prompt_logprobs(self, batch: SchedulerOutput, ran: RunnerOutput
                              ) -> list[Sequence]:
        """Gives each sequence the prompt logprobs its row brought; returns the batch's
        sequences whose prompt logprobs are all in and not yet sent."""
        sequences = self.scheduler.sequences
        for index, entries in ran.prompt_logprobs.items():
            req = batch.requests[index]
            if (seq := sequences.get(req.request_id)) is None:
                continue
            try:
                seq.add_prompt_logprobs(req.start_pos + 1, entries)
            except ValueError:  # NOTE: a bug of ours; its request goes on without them
                log.exception("request %s: prompt logprobs out of order", req.request_id)
        return [seq for req in batch.requests
                if (seq := sequences.get(req.request_id)) is not None and seq.prompt_logprobs_due]

    def _keep_accepted_drafts(self, batch: SchedulerOutput | None,
                              ran: RunnerOutput | None) -> None:
        """The draft model's cache keeps what the target accepted, forgets ended sequences."""
        if self.drafter is None:
            return
        accepted = {} if batch is None else {
            batch.requests[i].request_id: len(s.tokens) - 1 for i, s in ran.speculated.items()}
        self.drafter.keep_accepted(self.scheduler.drafted or {}, accepted)
        self.scheduler.drafted = None
        self.drafter.forget(self.scheduler.sequences)

    # -- grammars -------------------------------------------------------------------------

    def grammars(self) -> Grammars:
        """The model's grammar compiler; ValueError (the request's 400) if it could not be
        built. Waits for the set-up only when a grammar is asked for in the first seconds."""
        if self._grammars_setup.ident is not None:
            self._grammars_setup.join()
        if self._grammars is None:
            raise ValueError("response_format cannot be enforced: structured outputs are "
                             "unavailable on this engine (see its log)")
        return self._grammars

    def _set_up_grammars(self) -> None:
        """Builds the grammar compiler on its own thread at start: importing xgrammar and
        reading the vocabulary take a second or more, which would otherwise stall every
        request in the batch when the first constrained one arrives."""
        try:
            from engine.grammar import Grammars

            self._grammars = Grammars(self.config.model_dir, self.vocab_size,
                                      self.eos_token_ids)
        except Exception:  # noqa: BLE001 - the engine serves on; constrained requests get 400
            log.exception("structured outputs are unavailable: the grammar compiler failed")

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queues sequences whose grammar is compiled; ends those whose grammar failed."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished():
            # NOTE: with nothing else to run, wait for a compile rather than spin.
            futures.wait([f for _, f in self._compiling.values()], timeout=0.05,
                         return_when=futures.FIRST_COMPLETED)
        outputs = []
        for request_id, (seq, compiling) in list(self._compiling.items()):
            if not compiling.done():
                continue
            del self._compiling[request_id]
            try:
                for prompt in parallel.prompts_of(seq):
                    prompt.grammar = self.grammars().state(compiling.result())
            except Exception as exc:  # noqa: BLE001 - GrammarError: the client's schema
                outputs.append(RequestOutput(
                    request_id, finished=True, usage=usage_of(seq),
                    error=f"response_format cannot be enforced: {exc}"[:500],
                    error_code=protocol.ERROR_INVALID_REQUEST))
                continue
            self._enqueue(seq)
        return outputs

    # -- adapters -------------------------------------------------------------------------

    def forget_adapter(self, adapter_hash: str) -> None:
        """The platform deleted this adapter: let go of it wherever nothing still uses it."""
        if self.adapters is not None:
            self.adapters.forget(adapter_hash)

    def _admit_loaded(self) -> list[RequestOutput]:
        """Queues sequences whose adapter finished loading; ends those whose load failed."""
        if self.adapters is None:
            return []
        # NOTE: with nothing else to run, wait for a load rather than spin (and hold the GIL).
        ready, outputs = self.adapters.loaded(idle=not self.scheduler.has_unfinished())
        for seq in ready:
            self.scheduler.add(seq)
        return outputs

    def _settle(self, outputs: list[RequestOutput | None]) -> list[RequestOutput | None]:
        """Every output on its way out: lets go of the adapters of sequences that just
        finished; an embed request's become its one final output, with its vectors."""
        if self.adapters is not None:
            self.adapters.release_finished(outputs)
        return settle(outputs, self._embedding) if self._embedding else outputs

    # -- observability --------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything the heartbeat carries and Prometheus exports."""
        m, now = self.metrics, time.monotonic()
        return {
            "waiting": self.num_waiting(), "running": self.num_running(),
            **self.kv.snapshot(),
            "preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": m.prompt_tokens, "generation_tokens": m.generation_tokens,
            "prompt_tokens_per_s": round(m.prompt_rate.rate(now), 2),
            "generation_tokens_per_s": round(m.generation_rate.rate(now), 2),
            "requests_finished": dict(m.requests_finished), "steps": m.steps,
            "spec_decode_num_drafts": m.spec_drafts,
            "spec_decode_num_draft_tokens": m.spec_draft_tokens,
            "spec_decode_num_accepted_tokens": m.spec_accepted_tokens,
            "spec_decode_accepted_per_pos": list(m.spec_accepted_per_pos),
            "step_seconds": {k: round(v, 6) for k, v in m.clock.seconds.items()},
            "ttft": m.ttft.to_dict(), "itl": m.itl.to_dict(), "e2e": m.e2e.to_dict(),
            "queue": m.queue.to_dict(),
            "tenants_waiting": self.scheduler.waiting.num_tenants(),
            "tiers": m.tiers_snapshot(), "served": m.served_snapshot(),
            "adapters_in_slots": sorted(self.scheduler.slots.slot_of)
            if self.scheduler.slots else [],
            "time": time.time(), **self._adapter_snapshot(),
        }

    def placement(self) -> dict[str, Any]:
        """What the web tier places requests by (inference/routing.py): cached prefixes,
        tenants ahead of their share, adapters, KV use, and how many requests it holds."""
        summary = PrefixSummary.of(self.kv.pool.cached_keys(), self.config.block_size)
        return {"prefix": summary.to_dict(), "kv_usage": round(self.kv.usage, 4),
                "fair": self.scheduler.counters.standing(protocol.FAIR_STANDING_MAX),
                "adapters": self.resident_adapters(),
                "seats": self.config.max_num_seqs + self.config.max_waiting}

    def resident_adapters(self) -> list[str]:
        return self.adapters.resident() if self.adapters is not None else []

    def _adapter_snapshot(self) -> dict[str, Any]:
        if self.adapters is None:
            return {"lora": None, "adapter_slot_evictions": 0, "adapter_load": None}
        return {"lora": self.adapters.info(self.scheduler.waiting), **self.adapters.stats()}


def _send_prompt_logprobs(due: list[Sequence], outputs: list[RequestOutput]) -> None:
    """Puts each due sequence's prompt logprobs on its first output of the step (matched by
    request id and choice index: a prompt's own choice, p * n).

    NOTE: a sequence with no output this step (the step ran its prompt up to its last
    token, which runs and samples in a later one) sends them with its next output; an
    error's output carries none.
    """
    for seq in due:
        out = next((o for o in outputs if o.error is None and o.request_id == seq.reported_id
                    and o.index == seq.index), None)
        if out is not None:
            out.prompt_logprobs = list(seq.prompt_logprobs)
            seq.prompt_logprobs_sent = True


def _service(request: protocol.EngineRequest) -> dict[str, Any]:
    """How ``request``'s sequences are scheduled: tier, class, fair weight, queue deadline,
    how long its cache is kept, how many of its tenant's adapters may hold a slot."""
    return {"priority": request.priority, "tier": protocol.tier_of(request),
            "fair_weight": request.fair_weight, "queue_deadline": request.queue_deadline,
            "cache_retention_s": request.cache_retention_s,
            "max_resident_adapters": request.max_resident_adapters}
