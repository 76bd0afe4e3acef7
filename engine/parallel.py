"""Parallel sampling: one request, ``n`` choices, its prompt prefilled once.

The request's own sequence is choice 0 and runs the prompt alone. In the step where it
samples its first token, the runner also samples the first token of choices 1..n-1 from
that same logits row (``ScheduledRequest.fork_seeds``); the scheduler then forks each into
a sequence of its own (``fork``), holding the prompt's KV blocks with choice 0
(``KVCacheManager.fork``: copy-on-write). From there a choice is a sequence like any other:
scheduled, preempted and finished on its own. The request ends when its last choice does;
an error, abort or deadline ends all of them at once.

NOTE: choice i samples exactly as an n=1 request seeded with ``choice_seed(seed, i)``
(engine/seeds.py): its k-th token comes from the stream (choice_seed(seed, i), k), from
logits of its own prompt and history alone, masked by a grammar state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.batch import RunnerOutput, SampleFailure
from engine.detokenizer import IncrementalDetokenizer
from engine.seeds import choice_seed
from engine.sequence import Sequence, SequenceStatus


def choice_id(request_id: str, index: int) -> str:
    """The engine-internal id of choice ``index`` > 0 (choice 0 is the request's own)."""
    return f"{request_id}#{index}"


@dataclass(slots=True, eq=False)
class ParallelGroup:
    """The choices of one n > 1 request."""

    request_id: str
    seeds: list[int]  # choice i's seed
    members: list[Sequence] = field(default_factory=list)  # choice i at i; only 0 until forked
    forked: bool = False

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def running(self) -> bool:
        """Some choice has not finished."""
        return not self.forked or any(not m.finished for m in self.members)

    def choices(self, reason: str | None) -> list[dict[str, Any]]:
        """How each choice ended; one still running, or never forked, ends with ``reason``."""
        out = []
        for index in range(self.n):
            seq = self.members[index] if index < len(self.members) else None
            out.append({"index": index,
                        "finish_reason": seq.finish_reason if seq and seq.finished else reason,
                        "cumulative_logprob": seq.cumulative_logprob if seq else 0.0})
        return out


def start_group(seq: Sequence, n: int) -> None:
    """Makes ``seq`` choice 0 of an n-choice request (n > 1)."""
    seq.group = ParallelGroup(seq.request_id, [choice_seed(seq.seed, i) for i in range(n)],
                              [seq])


def choices_of(seq: Sequence, reason: str | None) -> list[dict[str, Any]] | None:
    """The final event's choices for a request ended by ``reason`` (None when n == 1)."""
    return None if seq.group is None else seq.group.choices(reason)


def seats(seq: Sequence) -> int:
    """Running sequences ``seq`` will take: n for a request that has not forked yet."""
    group = seq.group
    return 1 if group is None or group.forked else group.n


def fork_failure(forks: RunnerOutput | None, expected: int) -> str | None:
    """Why the other choices of a row that forked cannot start, if they cannot."""
    if not expected:
        return None
    if forks is None or len(forks.sampled) != expected:
        return "the runner sampled no first token for the other choices"
    return next((t.reason for t in forks.sampled if isinstance(t, SampleFailure)), None)


def forks_due(seq: Sequence, sample: bool) -> tuple[list[int], list[Any]]:
    """Seeds and grammar states of the choices that take their first token from this step's
    row of ``seq``: choice 0's first sample, before anything forked.

    NOTE: the states fork before choice 0 accepts a token, so each starts where it does.
    """
    group = seq.group
    if group is None or group.forked or not sample:
        return [], []
    seeds = group.seeds[1:]
    grammars = [seq.grammar.fork() for _ in seeds] if seq.grammar is not None else []
    return seeds, grammars


def fork(parent: Sequence, index: int, grammar: Any) -> Sequence:
    """Choice ``index`` of ``parent``'s request, its prompt computed (its KV blocks are
    the parent's), about to take its first token. ``parent`` has taken none yet."""
    if parent.num_output_tokens or parent.num_uncomputed:
        raise ValueError("a choice forks from a sequence whose prompt just ran")
    detok = parent.detokenizer
    return Sequence(
        request_id=choice_id(parent.group.request_id, index), token_ids=list(parent.token_ids),
        num_prompt_tokens=parent.num_prompt_tokens, params=parent.params,
        seed=parent.group.seeds[index], tenant_id=parent.tenant_id, priority=parent.priority,
        cache_scope=parent.cache_scope, deadline=parent.deadline,
        detokenizer=None if detok is None else IncrementalDetokenizer(
            detok.tokenizer, detok.stop, skip_special_tokens=detok.skip_special_tokens),
        adapter_hash=parent.adapter_hash, grammar=grammar, group=parent.group, index=index,
        status=SequenceStatus.RUNNING, num_computed_tokens=parent.num_computed_tokens,
        num_cached_tokens=parent.num_cached_tokens,
        num_prompt_tokens_done=parent.num_prompt_tokens_done, arrival=parent.arrival,
        scheduled_at=parent.scheduled_at)
