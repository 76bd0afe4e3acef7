"""One request's state inside the engine: its tokens, progress, and how it ends."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine import protocol
from engine.batch import PromptLogprob
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # the prompt, then every output token
    num_prompt_tokens: int
    params: SamplingParams
    seed: int  # the request's seed, or one drawn at arrival: recompute resamples the same
    tenant_id: str = ""
    priority: int = 0  # the plan's class within its tier; lower runs first
    tier: str = protocol.TIER_DEFAULT  # its service tier (protocol.TIERS)
    fair_weight: float = 1.0  # its tenant's weight in token-fair service (engine/fair_share.py)
    cache_retention_s: float = 0.0  # its cached blocks kept ahead of others (engine/host_kv.py)
    max_resident_adapters: int = 0  # its tenant's adapters in slots at most (0: no limit)
    queue_deadline: float | None = None  # unix seconds: not started by then, it ends unrun
    # Scopes prefix-cache hits: folded into the first block's hash (see kv_cache_manager).
    cache_scope: bytes = b""
    deadline: float | None = None  # unix seconds
    detokenizer: IncrementalDetokenizer | None = None
    adapter_hash: str | None = None  # LoRA adapter (content hash), None: the base model
    adapter_slot: int = -1  # its slot while running, else -1
    # Structured output: its grammar state (engine/grammar.py), advanced with each token.
    # NOTE: preemption recomputes the KV of every token kept, so the state stays valid.
    grammar: Any = None
    # More than one choice (n > 1, or several prompts): the request's choices
    # (engine/parallel.py), this one's index among them, and the sum of the raw logprobs
    # of its sampled tokens (for best_of).
    group: Any = None
    index: int = 0
    cumulative_logprob: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # set when it finishes (None: an error)
    # Tokens whose KV is in the cache; the next step runs token_ids[num_computed_tokens:].
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache when the prompt was first scheduled.
    num_cached_tokens: int = 0
    # The most prompt tokens ever computed (or found cached): what the prompt is billed for.
    num_prompt_tokens_done: int = 0
    num_preemptions: int = 0
    num_charged_tokens: int = 0  # positions its tenant was charged for (fair_share)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, in order
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None
    adapter_ready_at: float | None = None  # when its adapter's load, which it waited for, ended
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Speculative decoding (engine/speculative.py): the tokens proposed for the step being
    # run (empty: none), and its n-gram index and draft length (SequenceDrafts).
    draft: list[int] = field(default_factory=list)
    drafts: Any = None
    # Prompt logprobs (params.prompt_logprobs), gathered as the prompt's chunks run:
    # prompt_logprobs[j] is prompt token j + 1's. Sent once, when all are in.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # An embed request's input (engine/embedding.py, PooledInput): its prompt is run and
    # pooled into a vector, nothing is sampled, and it ends once its last chunk has run.
    embedding: Any = None

    @property
    def rank(self) -> tuple[int, int]:
        """Its class in the waiting queue, lower first: its tier's, then its plan's priority."""
        return protocol.TIERS.index(self.tier), self.priority

    @property
    def reported_id(self) -> str:
        """The id its outputs carry: the request's, for every choice of it."""
        return self.request_id if self.group is None else self.group.request_id

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and is its prompt's own sequence (a request's, or
        choice p * n of one with several), not a choice forked from one: those report none."""
        return self.params.prompt_logprobs is not None and (
            self.group is None or self.index % self.group.n == 0)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It wants prompt logprobs and has yet to gather some."""
        return self.wants_prompt_logprobs \
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def prompt_logprobs_due(self) -> bool:
        """Its prompt logprobs are all in and not yet sent."""
        return self.wants_prompt_logprobs and not self.needs_prompt_logprobs \
            and not self.prompt_logprobs_sent

    def add_prompt_logprobs(self, first: int, entries: list[PromptLogprob]) -> None:
        """Keeps ``entries``, the logprobs of prompt tokens ``first``, ``first + 1``, ...

        NOTE: a sequence preempted and recomputed from its start runs its prompt again; the
        entries it holds already are not taken twice.
        """
        if not self.wants_prompt_logprobs:
            return
        have = len(self.prompt_logprobs)  # prompt tokens 1..have are in
        if first > have + 1:
            raise ValueError(f"prompt logprobs from token {first} leave a gap after {have}")
        self.prompt_logprobs.extend(entries[have + 1 - first:])

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def stop_reason(self) -> str | int | None:
        """What stopped it, as vLLM reports it: the stop string its text ended at, or the
        stop token id it sampled; None for EOS, a grammar's end or the token limit."""
        if self.detokenizer is not None and self.detokenizer.stop_string is not None:
            return self.detokenizer.stop_string
        last = self.token_ids[-1] if self.num_output_tokens else None
        return last if last is not None and last in self.params.stop_token_ids else None

    def finish_reason_after(self, token: int, eos_token_ids: frozenset[int],
                            max_model_len: int) -> str | None:
        """Why ``token``, just appended, ends it (protocol.FINISH_*); None: it goes on."""
        params = self.params
        if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids \
                or (self.grammar is not None and self.grammar.is_terminated) \
                or (self.detokenizer is not None and self.detokenizer.stopped):
            return protocol.FINISH_STOP
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return protocol.FINISH_LENGTH
        return None
