"""Continuous batching: who runs each step, with how many tokens, and what happened after.

Plain Python, no tensors. Each step the scheduler fills a token budget:

1. running sequences, decodes first, then prompt chunks (chunked prefill);
2. when the KV pool cannot hold a running sequence's next tokens, the lowest-priority,
   latest-arrived running sequence is preempted: its blocks go back to the pool and it
   waits to be recomputed (its prompt and output so far run again as a prefill); the
   victim is of the lowest tier, then the tenant most served; the spare tiers (flex, the
   Batch API's lines) run on spare capacity only (engine/tiers.py);
3. then waiting sequences, by tier and token-fairly across tenants (``FairQueue``), each
   starting from whatever prefix of it the prefix cache already holds.

``postprocess`` takes the runner's sampled tokens, appends them, detokenizes, and
decides who stopped. A request with several prompts queues a sequence for each; with
n > 1 choices, each prompt's forks there once it has run (engine/parallel.py), and its
choices are sequences of their own from then on.
"""

from __future__ import annotations

import time

from engine import parallel, protocol, speculative, tiers
from engine.batch import (
    RunnerOutput,
    SampleFailure,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from engine.fair_queue import FairQueue
from engine.fair_share import ServiceCounters
from engine.kv_cache_manager import KVCacheManager
from engine.lora.slots import AdapterSlots, SlotClaims
from engine.metrics import EngineMetrics
from engine.outputs import RequestOutput, Usage, merge_outputs
from engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: frozenset[int] = frozenset(),
                 enable_chunked_prefill: bool = True,
                 metrics: EngineMetrics | None = None,
                 slots: AdapterSlots | None = None, speculative_tokens: int = 0,
                 speculative_max_batch: int = 4, reserve_seats: int = 0,
                 fair_share: str = "tokens") -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.enable_chunked_prefill = enable_chunked_prefill
        self.metrics = metrics or EngineMetrics()
        self.slots = slots
        # Speculative decoding (engine/speculative.py): the most draft tokens a sequence
        # verifies in a step (0: off), and the most decodes a step may have to speculate.
        self.speculative_tokens = speculative_tokens
        self.speculative_max_batch = speculative_max_batch
        # With a draft model: its proposals for the next step, by sequence (else n-grams).
        self.drafted: dict[str, list[int]] | None = None
        self.speculation_paused = False  # set per step by the engine's SpeculationGovernor
        self.reserve_seats = reserve_seats  # seats only the priority tier may take
        self.counters = ServiceCounters(fair_share)  # each tenant's service here
        self.waiting = FairQueue(self.counters)
        self.spare_sits_out = False  # this step: a default or priority sequence is starting
        self.spare_tokens_left = 0  # this step: what spare-tier work may still take
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}  # by engine-internal id (parallel.choice_id)
        # Requests with more than one choice (engine/parallel.py), by request id.
        self.groups: dict[str, parallel.ParallelGroup] = {}
        self.num_preemptions = 0

    # -- requests in and out ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a new request: ``seq``, prompt 0's sequence, and those of its other prompts."""
        prompts = parallel.prompts_of(seq)
        if any(p.request_id in self.sequences for p in prompts):
            raise ValueError(f"request {seq.request_id} is already in the engine")
        if seq.adapter_hash is not None and self.slots is None:
            raise ValueError("this engine serves no LoRA adapters")
        if seq.group is not None:
            self.groups[seq.request_id] = seq.group
        for p in prompts:
            self.sequences[p.request_id] = p
            self.counters.arrive(p.tenant_id)
            self.waiting.push(p)

    def abort(self, request_id: str, reason: str | None,
              error: str | None = None) -> RequestOutput | None:
        """Ends a request (every choice of it; ``request_id`` may name any one)."""
        seq = self.sequences.get(request_id)
        group = self.groups.get(request_id) if seq is None else seq.group
        if group is not None:
            # NOTE: text a choice held back (a possible stop string's start) is dropped.
            return self._end_group(group, reason, error)
        if seq is None:
            return None
        text = seq.detokenizer.flush() if seq.detokenizer else ""
        return self._finish(seq, reason, text=text, error=error)

    def expire(self, now: float | None = None) -> list[RequestOutput]:
        """Ends every request whose deadline has passed, and every one not yet started by its
        queue deadline."""
        now = time.time() if now is None else now
        late = dict.fromkeys(s.reported_id for s in self.sequences.values()
                             if s.deadline is not None and now >= s.deadline)
        unstarted = dict.fromkeys(
            s.reported_id for s in self.sequences.values()
            if s.queue_deadline is not None and now >= s.queue_deadline
            and s.reported_id not in late and not self._started(s))
        return [self.abort(request_id, protocol.FINISH_DEADLINE) for request_id in late] + \
            [self.abort(request_id, protocol.FINISH_QUEUE_TIMEOUT) for request_id in unstarted]

    @staticmethod
    def _started(seq: Sequence) -> bool:
        """Whether any prompt of ``seq``'s request has been scheduled."""
        return any(p.scheduled_at is not None for p in parallel.prompts_of(seq))

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduled: dict[str, tuple[Sequence, int]] = {}  # in batch order
        self.kv.index_restored()
        victim = tiers.seat_to_yield(self.waiting, self.running, self.kv, self.max_num_seqs,
                                     self.reserve_seats,
                                     seats_by_share=not self.counters.by_requests)
        if victim is not None:
            self._preempt(victim)
        self.spare_sits_out = tiers.interactive_starting(self.waiting, self.running)
        self.spare_tokens_left = tiers.SPARE_STEP_TOKENS
        budget, preempted = self._schedule_running(scheduled, self.max_num_batched_tokens)
        # New work only when nothing had to make room this step.
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        return SchedulerOutput([self._scheduled(seq, n) for seq, n in scheduled.values()],
                               self.kv.take_copies(), self.kv.take_host_moves(),
                               self.kv.take_host_ahead())

    def _schedule_running(self, scheduled: dict[str, tuple[Sequence, int]],
                          budget: int) -> tuple[int, bool]:
        """Running sequences first, preempting the lowest priority when the KV pool is
        full; returns the token budget left and whether anything was preempted.

        Decodes first, in arrival order, spare ones last; then prompt chunks, the most
        deserving first (tier, then the tenant least served). A chunk leaves the budget to
        the prompts of the waiting sequences more deserving than it that would start next:
        a tenant's long prompts already running do not keep less-served tenants' new
        requests out."""
        preempted = False
        key = self._deserving
        queue = sorted((s for s in self.running if s.num_uncomputed <= 1),
                       key=tiers.is_spare) + sorted(
            (s for s in self.running if s.num_uncomputed > 1), key=key)
        ahead = tiers.next_to_start(self.waiting, self.running, self.kv, self.max_num_seqs,
                                    self.reserve_seats, budget,
                                    chunked=self.enable_chunked_prefill,
                                    spare_sits_out=self.spare_sits_out)
        speculate = self.speculative_tokens > 0 and not self.speculation_paused and sum(
            s.num_uncomputed == 1 for s in queue) <= self.speculative_max_batch
        for seq in queue:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or (
                    self.spare_sits_out and tiers.sits_out(seq)):
                continue  # preempted earlier in this loop, or spare work sitting out
            n = min(seq.num_uncomputed, budget, self._spare_cap(seq))
            if seq.num_uncomputed > 1 and ahead:
                owed = sum(min(s.num_tokens, budget) for s in ahead if key(s) < key(seq))
                n = min(n, budget - min(owed, budget))
            if n == 0 or (n < seq.num_uncomputed and not self.enable_chunked_prefill):
                continue
            seq.draft = self._draft(seq, budget - 1) \
                if speculate and seq.num_uncomputed == 1 else []
            n += len(seq.draft)
            if seq.draft and not self.kv.allocate_slots(seq, n):
                n, seq.draft = n - len(seq.draft), []  # speculation never preempts anyone
            while not self.kv.allocate_slots(seq, n):
                victim = max(self.running, key=lambda s: (
                    s.rank, self.counters[s.tenant_id], s.arrival))
                self._preempt(victim)
                preempted = True
                if victim.request_id in scheduled:  # it gives back what it was granted
                    budget += scheduled.pop(victim.request_id)[1]
                if victim is seq:
                    break
            else:
                scheduled[seq.request_id] = (seq, n)
                # NOTE: draft tokens are not in token_ids: only verified ones are indexed.
                self.kv.cache_full_blocks(seq, seq.num_computed_tokens + n)
                budget -= n
                self._took(seq, n)
        return budget, preempted

    def _deserving(self, seq: Sequence) -> tuple[tuple[int, int], float]:
        """Lower goes first: its class (tier, plan priority), then its tenant's service."""
        return seq.rank, self.counters[seq.tenant_id]

    def _spare_cap(self, seq: Sequence) -> int:
        """The most tokens ``seq`` may run this step: spare-tier work takes a short share."""
        return self.spare_tokens_left if tiers.is_spare(seq) else seq.num_tokens

    def _took(self, seq: Sequence, n: int) -> None:
        """``seq`` runs ``n`` tokens this step: its tenant is charged for the service."""
        served = self.counters.charge(seq, seq.num_computed_tokens, n)
        self.metrics.record_service(seq.tenant_id, seq.tier, served)
        if tiers.is_spare(seq):
            self.spare_tokens_left -= n

    def _draft(self, seq: Sequence, room: int) -> list[int]:
        """The tokens ``seq`` speculates this step (engine/speculative.py): none unless it
        may, at most ``room`` and never past its max_tokens or the context."""
        limit = min(self._draft_limit(seq), room)
        if limit <= 0:
            return []
        if self.drafted is not None:  # the draft model's, proposed before this step
            draft = self.drafted.get(seq.request_id, [])[:limit]
        else:
            draft = seq.drafts.propose(seq.token_ids, limit)
        if draft and seq.grammar is not None:  # only what the grammar accepts is verified
            draft = draft[:seq.grammar.accepts_prefix(draft)]
        return draft

    def _draft_limit(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may speculate now (0: none)."""
        forks = seq.group is not None and seq.group.unforked(seq)
        if not speculative.speculates(seq.params, forks=forks):
            return 0
        if seq.drafts is None:
            seq.drafts = speculative.SequenceDrafts(self.speculative_tokens)
        return min(seq.drafts.length, seq.params.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1)

    def draft_wanted(self) -> list[tuple[Sequence, int]]:
        """The running sequences that may speculate in the next step, each with its most
        draft tokens: what a draft model proposes for before ``schedule``."""
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        if not self.speculative_tokens or self.speculation_paused \
                or len(decoding) > self.speculative_max_batch:
            return []
        return [(s, k) for s in decoding if (k := self._draft_limit(s)) > 0]

    def _schedule_waiting(self, scheduled: dict[str, tuple[Sequence, int]], budget: int) -> None:
        """Waiting sequences in fair order. A sequence whose adapter has no slot for it is
        passed over (``SlotClaims``); one that does not fit the KV pool stops the walk."""
        claims = SlotClaims(self.slots)
        seats = sum(parallel.seats(s) for s in self.running)  # an unforked prompt's: n
        for seq in self.waiting.candidates():
            if budget == 0 or not tiers.may_start(seq, seats, self.max_num_seqs,
                                                  self.reserve_seats) or (
                    self.spare_sits_out and tiers.is_spare(seq)):
                break
            if seq.adapter_hash is not None and not claims.admit(seq.adapter_hash, seq.tenant_id):
                continue
            computed, num_cached = self.kv.get_computed_blocks(seq)
            # A prefix coming back from the host tier is copied beside the step of those
            # running, and only its own sequence waits for it (it starts at the next step).
            if self.running and self.kv.restore_ahead(seq, computed):
                continue
            n = min(seq.num_tokens - num_cached, budget, self._spare_cap(seq))
            if n == 0 or (n < seq.num_tokens - num_cached and not self.enable_chunked_prefill):
                break
            if not self.kv.allocate_slots(seq, n, computed):
                break
            self._start(seq, num_cached)
            scheduled[seq.request_id] = (seq, n)
            self.kv.cache_full_blocks(seq, seq.num_computed_tokens + n)
            budget -= n
            self._took(seq, n)
            seats += parallel.seats(seq)

    def _start(self, seq: Sequence, num_cached: int) -> None:
        """A waiting sequence whose KV blocks were just allocated starts (or restarts)."""
        self.waiting.take(seq)
        if seq.adapter_hash is not None:
            seq.adapter_slot = self.slots.acquire(seq.adapter_hash, seq.tenant_id)
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
            if req.draft:
                outputs.append(self._advance_speculated(seq, req, ran, index, now))
                continue
            seq.num_computed_tokens += len(req.token_ids)
            seq.num_prompt_tokens_done = max(seq.num_prompt_tokens_done,
                                             min(seq.num_computed_tokens, seq.num_prompt_tokens))
            forks = ran.forks.get(index)
            failure = token.reason if isinstance(token, SampleFailure) else \
                parallel.fork_failure(forks, len(req.fork_seeds))
            if failure is not None:
                outputs.append(self.abort(seq.request_id, None, error=failure))
                continue
            if req.embedding is not None and req.sample:  # the input's vector is made
                outputs.append(self._finish(seq, protocol.FINISH_STOP))
            if not req.sample or token is None:
                continue
            # NOTE: the choices fork before the prompt's sequence takes its token: its first
            # may end it, freeing its blocks.
            children = self._fork(seq, req.fork_grammars) if forks else []
            outputs.append(self._advance(seq, token, now, ran.logprobs_of(index),
                                         ran.sampled_logprob_of(index)))
            outputs += [self._advance(child, forks.sampled[k], now, forks.logprobs_of(k),
                                      forks.sampled_logprob_of(k))
                        for k, child in enumerate(children)]
        return [out for out in outputs if out is not None]

    def _advance(self, seq: Sequence, token: int, now: float,
                 token_logprobs: TokenLogprobs | None = None,
                 sampled_logprob: float | None = None) -> RequestOutput | None:
        """Appends a sampled token (with its logprobs where asked, and its raw logprob for a
        choice's cumulative one); what it adds to the output."""
        if seq.status is not SequenceStatus.RUNNING:
            return None  # another choice's failure ended the request
        seq.token_ids.append(token)
        if seq.grammar is not None and not seq.grammar.accept(token):
            # NOTE: the mask allowed only tokens the grammar accepts; this is a bug.
            return self.abort(seq.request_id, None, error="the grammar refused the sampled token")
        seq.cumulative_logprob += sampled_logprob or 0.0
        if seq.first_token_at is None:
            seq.first_token_at = now
            if seq.index == 0:  # a request's first token (its first prompt's)
                self.metrics.record_first_token(now - seq.arrival, seq.tier)
        else:
            self.metrics.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        stop_token = token in seq.params.stop_token_ids
        # NOTE: a stop token id ends the output like EOS: counted, not in the text, and
        # neither has logprobs (the client sees no token for them).
        text = seq.detokenizer.add_token(token) if seq.detokenizer and not stop_token else ""
        hidden = stop_token or (token in self.eos_token_ids and not seq.params.ignore_eos)
        logprobs = None if hidden else token_logprobs
        reason = seq.finish_reason_after(token, self.eos_token_ids, self.max_model_len)
        if reason is None:
            return RequestOutput(seq.reported_id, text_delta=text, token_ids=[token],
                                 logprobs=None if logprobs is None else [logprobs],
                                 index=seq.index)
        if seq.detokenizer:
            text += seq.detokenizer.flush()
        out = self._finish(seq, reason, text=text, token_ids=[token])
        out.logprobs = None if logprobs is None else [logprobs]
        return out

    def _advance_speculated(self, seq: Sequence, req: ScheduledRequest, ran: RunnerOutput,
                            index: int, now: float) -> RequestOutput | None:
        """Appends what a speculating row yielded: the draft tokens the model chose, then its
        own; the KV of the rejected ones is given back."""
        seq.draft = []
        token = ran.sampled[index]
        if isinstance(token, SampleFailure):
            return self.abort(seq.request_id, None, error=token.reason)
        verified = ran.speculated[index]
        tokens = verified.tokens
        accepted = len(tokens) - 1
        # The last token and the accepted drafts are in the KV now; the rest is not.
        seq.num_computed_tokens += 1 + accepted
        self.kv.trim(seq, seq.num_computed_tokens + 1)
        seq.drafts.update(len(req.draft), accepted)
        self.metrics.record_draft(len(req.draft), accepted)
        # NOTE: the tokens arrived together; the time since the last one is spread over them.
        began = seq.last_token_at or now
        outputs = []
        for k, token in enumerate(tokens):
            outputs.append(self._advance(
                seq, token, began + (now - began) * (k + 1) / len(tokens),
                verified.logprobs[k] if verified.logprobs else None,
                verified.sampled_logprobs[k] if verified.sampled_logprobs else None))
            if seq.status is not SequenceStatus.RUNNING:
                break
        return merge_outputs([out for out in outputs if out is not None])

    def _fork(self, parent: Sequence, grammars: list) -> list[Sequence]:
        """The other n - 1 choices of ``parent``'s prompt, sharing its KV blocks."""
        group, first = parent.group, parent.index + 1
        children = [parallel.fork(parent, first + k, grammars[k] if grammars else None)
                    for k in range(group.n - 1)]
        for child in children:
            self.kv.fork(parent, child)
            if child.adapter_hash is not None:
                child.adapter_slot = self.slots.acquire(child.adapter_hash)
            self.sequences[child.request_id] = child
            self.counters.arrive(child.tenant_id)
            self.running.append(child)
            group.members[child.index] = child
        return children

    # -- helpers --------------------------------------------------------------------------

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledRequest:
        start = seq.num_computed_tokens
        if seq.draft:  # the last token, then the draft (n counts both)
            return ScheduledRequest(
                request_id=seq.request_id, token_ids=seq.token_ids[start:] + seq.draft,
                start_pos=start, block_table=self.kv.block_table(seq), sample=True,
                sampling=seq.params, seed=seq.seed, num_output_tokens=seq.num_output_tokens,
                adapter_slot=seq.adapter_slot, adapter_hash=seq.adapter_hash,
                history=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
                grammar=seq.grammar, sampled_logprob=seq.group is not None,
                draft=list(seq.draft))
        fork_seeds, fork_grammars = parallel.forks_due(seq, start + n == seq.num_tokens)
        return ScheduledRequest(
            request_id=seq.request_id, token_ids=seq.token_ids[start:start + n], start_pos=start,
            block_table=self.kv.block_table(seq), sample=start + n == seq.num_tokens,
            sampling=seq.params, seed=seq.seed, num_output_tokens=seq.num_output_tokens,
            adapter_slot=seq.adapter_slot, adapter_hash=seq.adapter_hash,
            history=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
            grammar=seq.grammar, fork_seeds=fork_seeds, fork_grammars=fork_grammars,
            sampled_logprob=seq.group is not None, embedding=seq.embedding)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop its KV; it runs prompt + output again when readmitted."""
        self.running.remove(seq)
        self.kv.free(seq)
        self._release_slot(seq)
        seq.draft = []
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.metrics.record_preemption(seq.tier)
        self.waiting.push_front(seq)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.adapter_slot >= 0:
            self.slots.release(seq.adapter_hash)
            seq.adapter_slot = -1

    def _finish(self, seq: Sequence, reason: str | None, *, text: str = "",
                token_ids: list[int] | None = None, error: str | None = None) -> RequestOutput:
        """Ends one sequence: the request's final output, or, while other choices of it
        run, this choice's last delta."""
        self._release(seq, reason)
        group = seq.group
        if group is None:
            usage = self._finished(seq, reason)
            return RequestOutput(seq.request_id, text_delta=text, token_ids=token_ids or [],
                                 finished=True, finish_reason=reason, usage=usage,
                                 stop_reason=seq.stop_reason, error=error)
        if group.running:
            return RequestOutput(group.request_id, text_delta=text, token_ids=token_ids or [],
                                 index=seq.index)
        return self._final(group, group.members[0].finish_reason, error, index=seq.index,
                           text=text, token_ids=token_ids)

    def _end_group(self, group: parallel.ParallelGroup, reason: str | None,
                   error: str | None) -> RequestOutput:
        """Ends every choice of a request at once (abort, deadline, error)."""
        for seq in group.members:
            if seq is not None and not seq.finished:
                self._release(seq, reason)
        return self._final(group, reason, error)

    def _final(self, group: parallel.ParallelGroup, reason: str | None, error: str | None, *,
               index: int = 0, text: str = "", token_ids: list[int] | None = None
               ) -> RequestOutput:
        del self.groups[group.request_id]
        return RequestOutput(group.request_id, text_delta=text, token_ids=token_ids or [],
                             finished=True, finish_reason=reason,
                             usage=self._finished(group.members[0], reason), error=error,
                             index=index, choices=group.choices(reason))

    def _finished(self, seq: Sequence, reason: str | None) -> Usage:
        """A request's usage as it ends; counted in the metrics."""
        usage = parallel.usage_of(seq)
        self.metrics.record_finish(reason or "error", total_s=usage.total_s,
                                   queue_s=usage.queue_s, tier=seq.tier)
        return usage

    def _release(self, seq: Sequence, reason: str | None) -> None:
        """Takes a sequence out of the queues and gives back its KV blocks and slot."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self._release_slot(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.sequences[seq.request_id]
        self.counters.leave(seq.tenant_id)

