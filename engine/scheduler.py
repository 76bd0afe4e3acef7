"""Continuous batching: who runs each step, with how many tokens, and what happened after.

Plain Python, no tensors. Each step the scheduler fills a token budget:

1. running sequences, decodes first, then prompt chunks (chunked prefill);
2. when the KV pool cannot hold a running sequence's next tokens, the lowest-priority,
   latest-arrived running sequence is preempted: its blocks go back to the pool and it
   waits to be recomputed (its prompt and output so far run again as a prefill);
3. then waiting sequences, fairly across tenants (``FairQueue``), each starting from
   whatever prefix of it the prefix cache already holds.

``postprocess`` takes the runner's sampled tokens, appends them, detokenizes, and
decides who stopped.
"""

from __future__ import annotations

import time

from engine import protocol
from engine.batch import RunnerOutput, SampleFailure, ScheduledRequest, SchedulerOutput
from engine.fair_queue import FairQueue
from engine.kv_cache_manager import KVCacheManager
from engine.lora.slots import AdapterSlots
from engine.metrics import EngineMetrics
from engine.outputs import RequestOutput, Usage
from engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: frozenset[int] = frozenset(),
                 enable_chunked_prefill: bool = True,
                 metrics: EngineMetrics | None = None,
                 slots: AdapterSlots | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.enable_chunked_prefill = enable_chunked_prefill
        self.metrics = metrics or EngineMetrics()
        self.slots = slots
        self.waiting = FairQueue()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self.num_preemptions = 0

    # -- requests in and out ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.sequences:
            raise ValueError(f"request {seq.request_id} is already in the engine")
        if seq.adapter_hash is not None and self.slots is None:
            raise ValueError("this engine serves no LoRA adapters")
        self.sequences[seq.request_id] = seq
        self.waiting.push(seq)

    def abort(self, request_id: str, reason: str | None,
              error: str | None = None) -> RequestOutput | None:
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        text = seq.detokenizer.flush() if seq.detokenizer else ""
        return self._finish(seq, reason, text=text, error=error)

    def expire(self, now: float | None = None) -> list[RequestOutput]:
        """Ends every sequence whose deadline has passed."""
        now = time.time() if now is None else now
        late = [s for s in self.sequences.values() if s.deadline is not None and now >= s.deadline]
        return [self.abort(s.request_id, protocol.FINISH_DEADLINE) for s in late]

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduled: dict[str, tuple[Sequence, int]] = {}  # in batch order
        budget, preempted = self._schedule_running(scheduled, self.max_num_batched_tokens)
        # New work only when nothing had to make room this step.
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        return SchedulerOutput([self._scheduled(seq, n) for seq, n in scheduled.values()])

    def _schedule_running(self, scheduled: dict[str, tuple[Sequence, int]],
                          budget: int) -> tuple[int, bool]:
        """Running sequences first, preempting the lowest priority when the KV pool is
        full; returns the token budget left and whether anything was preempted."""
        preempted = False
        # NOTE: a stable sort: decodes (one token to run) first, each group in arrival order.
        queue = sorted(self.running, key=lambda s: s.num_uncomputed > 1)
        for seq in queue:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed, budget)
            if n < seq.num_uncomputed and not self.enable_chunked_prefill:
                continue
            while not self.kv.allocate_slots(seq, n):
                victim = max(self.running, key=lambda s: (s.priority, s.arrival))
                self._preempt(victim)
                preempted = True
                if victim.request_id in scheduled:  # it gives back what it was granted
                    budget += scheduled.pop(victim.request_id)[1]
                if victim is seq:
                    break
            else:
                scheduled[seq.request_id] = (seq, n)
                self.kv.cache_full_blocks(seq, seq.num_computed_tokens + n)
                budget -= n
        return budget, preempted

    def _schedule_waiting(self, scheduled: dict[str, tuple[Sequence, int]], budget: int) -> None:
        """Waiting sequences in fair order. A sequence whose adapter has no free slot is
        passed over; one that does not fit the KV pool stops the walk.

        NOTE: once one waits for a slot, no sequence after it takes an adapter slot, not
        even one whose adapter is already in: else a busy adapter's stream of requests
        keeps every slot busy and the one waiting never gets one. Now a slot drains."""
        waiting_for_slot = False
        for seq in self.waiting.candidates():
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.adapter_hash is not None and (
                    waiting_for_slot or not self.slots.can_acquire(seq.adapter_hash)):
                waiting_for_slot = True
                continue
            computed, num_cached = self.kv.get_computed_blocks(seq)
            n = min(seq.num_tokens - num_cached, budget)
            if n < seq.num_tokens - num_cached and not self.enable_chunked_prefill:
                break
            if not self.kv.allocate_slots(seq, n, computed):
                break
            self._start(seq, num_cached)
            scheduled[seq.request_id] = (seq, n)
            self.kv.cache_full_blocks(seq, seq.num_computed_tokens + n)
            budget -= n

    def _start(self, seq: Sequence, num_cached: int) -> None:
        """A waiting sequence whose KV blocks were just allocated starts (or restarts)."""
        self.waiting.take(seq)
        if seq.adapter_hash is not None:
            seq.adapter_slot = self.slots.acquire(seq.adapter_hash)
        if seq.scheduled_at is None:  # its first admission, not a readmission
            seq.scheduled_at = time.monotonic()
            seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            self.kv.record_prefix_lookup(seq.num_prompt_tokens, seq.num_cached_tokens)
        seq.num_computed_tokens = num_cached
        seq.num_prompt_tokens_done = max(seq.num_prompt_tokens_done,
                                         min(num_cached, seq.num_prompt_tokens))
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def postprocess(self, batch: SchedulerOutput, ran: RunnerOutput) -> list[RequestOutput]:
        """Advances every scheduled sequence and returns what each produced."""
        now = time.monotonic()
        outputs = []
        for index, (req, token) in enumerate(zip(batch.requests, ran.sampled, strict=True)):
            seq = self.sequences.get(req.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += len(req.token_ids)
            seq.num_prompt_tokens_done = max(seq.num_prompt_tokens_done,
                                             min(seq.num_computed_tokens, seq.num_prompt_tokens))
            if isinstance(token, SampleFailure):
                text = seq.detokenizer.flush() if seq.detokenizer else ""
                outputs.append(self._finish(seq, None, text=text, error=token.reason))
                continue
            if not req.sample or token is None:
                continue
            seq.token_ids.append(token)
            if seq.grammar is not None and not seq.grammar.accept(token):
                # NOTE: the mask allowed only tokens the grammar accepts; this is a bug.
                outputs.append(self._finish(seq, None, error="the grammar refused the sampled "
                                            "token"))
                continue
            if seq.first_token_at is None:
                seq.first_token_at = now
                self.metrics.ttft.observe(now - seq.arrival)
            else:
                self.metrics.itl.observe(now - seq.last_token_at)
            seq.last_token_at = now
            stop_token = token in seq.params.stop_token_ids
            # NOTE: a stop token id ends the output like EOS: counted, not in the text, and
            # neither has logprobs (the client sees no token for them).
            text = seq.detokenizer.add_token(token) if seq.detokenizer and not stop_token \
                else ""
            hidden = stop_token or (token in self.eos_token_ids and not seq.params.ignore_eos)
            logprobs = None if hidden else ran.logprobs_of(index)
            reason = self._stop_reason(seq, token)
            if reason is None:
                outputs.append(RequestOutput(
                    seq.request_id, text_delta=text, token_ids=[token],
                    logprobs=None if logprobs is None else [logprobs]))
            else:
                if seq.detokenizer:
                    text += seq.detokenizer.flush()
                out = self._finish(seq, reason, text=text, token_ids=[token])
                out.logprobs = None if logprobs is None else [logprobs]
                outputs.append(out)
        return outputs

    # -- helpers --------------------------------------------------------------------------

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledRequest:
        start = seq.num_computed_tokens
        return ScheduledRequest(
            request_id=seq.request_id, token_ids=seq.token_ids[start:start + n], start_pos=start,
            block_table=self.kv.block_table(seq), sample=start + n == seq.num_tokens,
            sampling=seq.params, seed=seq.seed, num_output_tokens=seq.num_output_tokens,
            adapter_slot=seq.adapter_slot, adapter_hash=seq.adapter_hash,
            history=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
            grammar=seq.grammar)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop its KV; it runs prompt + output again when readmitted."""
        self.running.remove(seq)
        self.kv.free(seq)
        self._release_slot(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(seq)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.adapter_slot >= 0:
            self.slots.release(seq.adapter_hash)
            seq.adapter_slot = -1

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eos_token_ids and not seq.params.ignore_eos:
            return protocol.FINISH_STOP
        if token in seq.params.stop_token_ids:
            return protocol.FINISH_STOP
        if seq.grammar is not None and seq.grammar.is_terminated:
            return protocol.FINISH_STOP
        if seq.detokenizer is not None and seq.detokenizer.stopped:
            return protocol.FINISH_STOP
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return protocol.FINISH_LENGTH
        return None

    def _finish(self, seq: Sequence, reason: str | None, *, text: str = "",
                token_ids: list[int] | None = None, error: str | None = None) -> RequestOutput:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self._release_slot(seq)
        seq.status = SequenceStatus.FINISHED
        del self.sequences[seq.request_id]
        self.metrics.record_finish(reason or "error")
        return RequestOutput(seq.request_id, text_delta=text, token_ids=token_ids or [],
                             finished=True, finish_reason=reason, usage=usage_of(seq),
                             error=error)


def usage_of(seq: Sequence) -> Usage:
    now = time.monotonic()
    return Usage(
        prompt_tokens=seq.num_prompt_tokens_done, completion_tokens=seq.num_output_tokens,
        cached_tokens=seq.num_cached_tokens,
        queue_s=(seq.scheduled_at or now) - seq.arrival,
        ttft_s=None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
        total_s=now - seq.arrival)
