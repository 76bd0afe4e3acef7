"""The plain dataclasses that cross between the scheduler and the model runner each step.

The scheduler decides who runs and how many tokens; the runner owns every tensor
and turns a ``SchedulerOutput`` into one sampled token per request that asked (or a
``SampleFailure`` for a row that could not be sampled).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    # Tokens to run this step: a chunk of the prompt (or of prompt + output when a
    # preempted request is recomputed), or the single token sampled last step.
    token_ids: list[int]
    # Position of token_ids[0]; equals the number of tokens already in the KV cache.
    start_pos: int
    # Physical KV blocks for positions [0, start_pos + len(token_ids)), in order.
    block_table: list[int]
    # True when this step reaches the end of the known tokens: sample one new token.
    sample: bool
    sampling: SamplingParams
    seed: int = 0  # with num_output_tokens, picks the random stream of this sample
    # Output tokens generated so far: the n-th sample of a request draws from a stream
    # keyed by (seed, n), so a recomputed or re-batched request samples the same.
    num_output_tokens: int = 0
    adapter_slot: int = -1  # LoRA slot; -1: the base model
    # The adapter (content hash) that must be in adapter_slot: AdapterLifecycle copies it
    # in if the slot holds anything else, and the runner refuses to run it otherwise.
    adapter_hash: str | None = None
    # The sequence's tokens so far (prompt, then output), read by penalties; not a copy.
    history: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    # Structured output: the sequence's grammar state (engine/grammar.py), which masks the
    # tokens it cannot accept; the runner reads it, the scheduler advances it.
    grammar: Any = None
    # n > 1, the step a prompt's sequence samples its first token: the seeds (and grammar
    # states, with a grammar) of its prompt's other choices, sampled from this row too.
    fork_seeds: list[int] = field(default_factory=list)
    fork_grammars: list[Any] = field(default_factory=list)
    # A choice of a request with several (engine/parallel.py): the runner returns the raw
    # logprob of each token it samples for the row (its choice's cumulative_logprob).
    sampled_logprob: bool = False
    # Speculative decoding: token_ids is [the last token] + draft, and the runner keeps
    # each draft token the model itself chooses (RunnerOutput.speculated).
    draft: list[int] = field(default_factory=list)
    # An embedding input (engine/embedding.py): never sampled (no logits are computed for
    # it); its rows are pooled into this state, and ``sample`` marks its last chunk.
    embedding: Any = None

    @property
    def is_decode(self) -> bool:
        """One new token after a computed context: a decode (or a 1-token prompt tail)."""
        return len(self.token_ids) == 1


@dataclass(slots=True)
class SchedulerOutput:
    # Decodes first, then prefill chunks; the runner keeps this order in its result.
    requests: list[ScheduledRequest]
    # (source, destination) KV blocks the runner copies, every layer, before the forward
    # pass: copy-on-write of a block choices of one request shared (KVCacheManager.fork).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Copies between the pool and the host tier, in order, before those: ("save", block,
    # slot) and ("load", slot, block) (engine/host_kv.py).
    host_moves: list[tuple[str, int, int]] = field(default_factory=list)
    # Copies beside the forward pass (HostKVTier.take_ahead): ("load", slot, block) into a
    # waiting sequence's fresh blocks, then ("save", block, slot) of blocks free in the
    # pool; no request of this step reads or writes those blocks.
    host_ahead: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """Log-probabilities of one sampled token under the model (its raw log-softmax)."""

    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens, most likely first


@dataclass(slots=True, frozen=True)
class PromptLogprob:
    """One prompt token's log-probability under the model given the tokens before it (its
    raw log-softmax, as vLLM's prompt_logprobs: no temperature, penalty or bias)."""

    logprob: float
    rank: int  # 1 + how many tokens are strictly more likely at its position
    top: list[tuple[int, float]]  # the most likely tokens there, most likely first


@dataclass(slots=True)
class RunnerOutput:
    """What one forward pass produced, in the order of ``SchedulerOutput.requests``."""

    # A token for each request that sampled, None for the others, SampleFailure for a row
    # that could not be sampled.
    sampled: list[int | SampleFailure | None]
    # Set for the rows whose request asked for logprobs.
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # The raw log-probability of the sampled token, for rows that asked (sampled_logprob).
    sampled_logprobs: list[float | None] = field(default_factory=list)
    # Row index -> the first tokens of the prompt's other choices when that row forked
    # (its fork_seeds), one row per choice in fork_seeds order.
    forks: dict[int, RunnerOutput] = field(default_factory=dict)
    # Row index -> what a speculating row yields (sampled[row] is its first token).
    speculated: dict[int, Speculated] = field(default_factory=dict)
    # Row index -> for a row whose request asked for prompt logprobs, those of the prompt
    # tokens its positions predict: start_pos + 1, start_pos + 2, ... (before the end of the
    # prompt), in order.
    prompt_logprobs: dict[int, list[PromptLogprob]] = field(default_factory=dict)

    def logprobs_of(self, index: int) -> TokenLogprobs | None:
        return self.logprobs[index] if self.logprobs else None

    def sampled_logprob_of(self, index: int) -> float | None:
        return self.sampled_logprobs[index] if self.sampled_logprobs else None

    @property
    def num_sampled(self) -> int:
        """Tokens sampled in the step, forks' included."""
        return sum(isinstance(t, int) for t in self.sampled) \
            + sum(f.num_sampled for f in self.forks.values()) \
            + sum(len(s.tokens) - 1 for s in self.speculated.values())


@dataclass(slots=True)
class Speculated:
    """A speculating row's tokens (engine/speculative.py): the draft tokens kept, then the
    model's own next one; and, where the row asked, each one's logprobs and raw logprob."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] | None = None
    sampled_logprobs: list[float] | None = None


@dataclass(slots=True, frozen=True)
class SampleFailure:
    """A row the runner could not sample (its logits were not finite): only its request fails."""

    reason: str
