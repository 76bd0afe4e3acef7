"""Several choices in one request: ``n`` samples of each of its prompts, each prompt
prefilled once.

Prompt p's sample i is choice ``k = p * n + i``. Each prompt has a sequence of its own
from the start, choice p * n (prompt 0's is the request's own sequence), which runs the
prompt alone; prompts share the request's tenant, adapter and prefix-cache scope. With
n > 1, in the step where a prompt's sequence samples its first token, the runner also
samples the first token of that prompt's other n - 1 choices from the same logits row
(``ScheduledRequest.fork_seeds``); the scheduler then forks each into a sequence of its
own (``fork``), holding the prompt's KV blocks with it (``KVCacheManager.fork``:
copy-on-write). From there a choice is a sequence like any other: scheduled, preempted
and finished on its own. The request ends when its last choice does; an error, abort or
deadline ends all of them at once.

NOTE: choice k samples exactly as an n=1 request on its prompt seeded with
``choice_seed(seed, k)`` (engine/seeds.py): its j-th token comes from the stream
(choice_seed(seed, k), j), from logits of its own prompt and history alone, masked by a
grammar state of its own.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from engine.batch import RunnerOutput, SampleFailure
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import Usage
from engine.seeds import choice_seed
from engine.sequence import Sequence, SequenceStatus


def choice_id(request_id: str, index: int) -> str:
    """The engine-internal id of choice ``index`` > 0 (choice 0 is the request's own)."""
    return f"{request_id}#{index}"


@dataclass(slots=True, eq=False)
class ParallelGroup:
    """The choices of one request with more than one: n per prompt."""

    request_id: str
    n: int  # choices per prompt
    seeds: list[int]  # choice k's seed
    # Choice k at k: each prompt's sequence (at p * n) from the start, its other choices
    # once it forks (None until then).
    members: list[Sequence | None]

    @property
    def prompts(self) -> list[Sequence]:
        """Each prompt's own sequence, in prompt order."""
        return self.members[::self.n]

    def unforked(self, seq: Sequence) -> bool:
        """``seq`` is a prompt's sequence whose other choices have yet to fork from it."""
        return self.n > 1 and seq.index % self.n == 0 and self.members[seq.index + 1] is None

    @property
    def running(self) -> bool:
        """Some choice has not finished (or not yet forked)."""
        return any(m is None or not m.finished for m in self.members)

    def choices(self, reason: str | None) -> list[dict[str, Any]]:
        """How each choice ended; one still running, or never forked, ends with ``reason``."""
        return [{"index": index,
                 "finish_reason": seq.finish_reason if seq and seq.finished else reason,
                 "cumulative_logprob": seq.cumulative_logprob if seq else 0.0,
                 "stop_reason": seq.stop_reason if seq and seq.finished else None}
                for index, seq in enumerate(self.members)]


def start_group(seq: Sequence, n: int, extra_prompts: Collection[list[int]] = ()) -> None:
    """Makes ``seq`` (prompt 0) choice 0 of a request with n choices per prompt, and gives
    each of ``extra_prompts`` a sequence of its own (n * prompts > 1)."""
    size = n * (1 + len(extra_prompts))
    group = ParallelGroup(seq.request_id, n, [choice_seed(seq.seed, k) for k in range(size)],
                          [None] * size)
    seq.group = group
    group.members[0] = seq
    for p, prompt in enumerate(extra_prompts, start=1):
        group.members[p * n] = _sibling(seq, prompt, p * n)  # waiting, like seq


def prompts_of(seq: Sequence) -> list[Sequence]:
    """The sequences of each prompt of ``seq``'s request, in order: [seq] when it has one."""
    return [seq] if seq.group is None else seq.group.prompts


def choices_of(seq: Sequence, reason: str | None) -> list[dict[str, Any]] | None:
    """The final event's choices for a request ended by ``reason`` (None with one choice)."""
    return None if seq.group is None else seq.group.choices(reason)


def seats(seq: Sequence) -> int:
    """Running sequences ``seq`` will take: n for a prompt's that has not forked yet."""
    group = seq.group
    return group.n if group is not None and group.unforked(seq) else 1


def fork_failure(forks: RunnerOutput | None, expected: int) -> str | None:
    """Why the other choices of a row that forked cannot start, if they cannot."""
    if not expected:
        return None
    if forks is None or len(forks.sampled) != expected:
        return "the runner sampled no first token for the other choices"
    return next((t.reason for t in forks.sampled if isinstance(t, SampleFailure)), None)


def forks_due(seq: Sequence, sample: bool) -> tuple[list[int], list[Any]]:
    """Seeds and grammar states of the choices that take their first token from this step's
    row of ``seq``: a prompt's first sample, before its other choices forked.

    NOTE: the states fork before ``seq`` accepts a token, so each starts where it does.
    """
    group = seq.group
    if group is None or not sample or not group.unforked(seq):
        return [], []
    seeds = group.seeds[seq.index + 1:seq.index + group.n]
    grammars = [seq.grammar.fork() for _ in seeds] if seq.grammar is not None else []
    return seeds, grammars


def fork(parent: Sequence, index: int, grammar: Any) -> Sequence:
    """Choice ``index`` of ``parent``'s prompt, the prompt computed (its KV blocks are the
    parent's), about to take its first token. ``parent`` has taken none yet."""
    if parent.num_output_tokens or parent.num_uncomputed:
        raise ValueError("a choice forks from a sequence whose prompt just ran")
    return _sibling(parent, parent.token_ids, index, grammar=grammar,
                    status=SequenceStatus.RUNNING,
                    num_computed_tokens=parent.num_computed_tokens,
                    num_cached_tokens=parent.num_cached_tokens,
                    num_prompt_tokens_done=parent.num_prompt_tokens_done,
                    scheduled_at=parent.scheduled_at)


def _sibling(seq: Sequence, token_ids: list[int], index: int, **state: Any) -> Sequence:
    """Choice ``index`` of ``seq``'s request on ``token_ids`` (a prompt), as ``seq`` is
    made: its params, tenant, scope, adapter and deadline; a detokenizer of its own."""
    detok = seq.detokenizer
    return Sequence(
        request_id=choice_id(seq.group.request_id, index), token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids), params=seq.params, seed=seq.group.seeds[index],
        tenant_id=seq.tenant_id, priority=seq.priority, tier=seq.tier,
        fair_weight=seq.fair_weight, cache_scope=seq.cache_scope, deadline=seq.deadline,
        queue_deadline=seq.queue_deadline, cache_retention_s=seq.cache_retention_s,
        max_resident_adapters=seq.max_resident_adapters,
        detokenizer=None if detok is None else IncrementalDetokenizer(
            detok.tokenizer, detok.stop, skip_special_tokens=detok.skip_special_tokens),
        adapter_hash=seq.adapter_hash, group=seq.group, index=index, arrival=seq.arrival,
        **state)


def usage_of(seq: Sequence) -> Usage:
    """A request's usage: each prompt counted once, the output of every choice."""
    prompts = prompts_of(seq)
    members = [m for m in seq.group.members if m is not None] if seq.group else [seq]
    arrival, now = prompts[0].arrival, time.monotonic()
    scheduled = min((p.scheduled_at for p in prompts if p.scheduled_at is not None),
                    default=now)
    first_token = min((m.first_token_at for m in members if m.first_token_at is not None),
                      default=None)
    return Usage(
        prompt_tokens=sum(p.num_prompt_tokens_done for p in prompts),
        completion_tokens=sum(m.num_output_tokens for m in members),
        cached_tokens=sum(p.num_cached_tokens for p in prompts),
        queue_s=scheduled - arrival,
        ttft_s=None if first_token is None else first_token - arrival,
        total_s=now - arrival,
        adapter_wait_s=None if prompts[0].adapter_ready_at is None
        else prompts[0].adapter_ready_at - arrival)
