"""Speculative decoding: propose a few tokens cheaply, verify them in one forward pass.

A running sequence that speculates runs ``[its last token] + draft`` in a step instead of
its last token alone; the step gives logits at every position, and a draft token is kept
while it is the token the model would have chosen there. The first token the model
disagrees on (or the one after the whole draft) is the step's own sample, so a step
yields one to ``1 + len(draft)`` tokens and never a different one: greedy output is
the same as without speculation.

Proposer: n-gram prompt lookup. The longest recent suffix of the sequence (up to
``MAX_NGRAM`` tokens) that occurred earlier in it is looked up, and the tokens that
followed that earlier occurrence are the draft. It needs no model, no adapter and no KV.

What may speculate (``speculates``): greedy sequences, and sampled ones without a seed
(verified by rejection sampling); penalties, logit bias, min_tokens, grammars and
logprobs apply per position (a draft is cut where its grammar refuses a token). Not a
prompt whose choices have not forked. Others run one token a step, as always.

Adaptive: a sequence's draft length follows its recent acceptance (``SequenceDrafts``);
no sequence speculates while more than ``max_batch`` decode, where a step is bound by
compute rather than by reading the weights, so speculation never costs throughput under
load; and speculation stays on only while decode steps with it yield more tokens per
second than without (``SpeculationGovernor``). Operators choose it
(``ATRIUM_SPECULATIVE``); tenants cannot.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from engine.batch import ScheduledRequest, Speculated
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

MAX_NGRAM = 4  # the longest suffix looked up
MIN_NGRAM = 1  # the shortest
MAX_CANDIDATES = 64  # earlier occurrences of the last token checked, latest first
MODES = ("off", "ngram")


def parse_mode(value: str) -> str:
    """``ATRIUM_SPECULATIVE``: ``off``, ``ngram`` or ``draft:PATH`` (a draft checkpoint's
    folder; ValueError otherwise). Returned normalised (``draft:`` and the path kept)."""
    text = (value or "off").strip()
    if text.lower().startswith("draft:"):
        if not text[len("draft:"):].strip():
            raise ValueError("draft:PATH needs the draft checkpoint's folder")
        return "draft:" + text[len("draft:"):].strip()
    mode = text.lower()
    if mode not in MODES:
        raise ValueError(f"speculative decoding must be one of {', '.join(MODES)} or "
                         f"draft:PATH, got {value!r}")
    return mode


def speculates(params: SamplingParams, *, forks: bool) -> bool:
    """Whether a sequence's next tokens can be verified: greedy (against the argmax), or
    sampled without a seed (by rejection sampling). NOTE: a seeded request never
    speculates: its tokens must be the same whatever shares its batch, and whether a
    sequence speculates depends on the batch."""
    return (params.greedy or params.seed is None) and not forks


def verify_row(logits: torch.Tensor, req: ScheduledRequest) -> Speculated:
    """What a speculating row yields from its logits [len(draft) + 1, vocab]: each
    position's logits shaped as the sampler would shape them with the draft before it in
    the history (penalties, bias, min_tokens) and masked by the grammar after the draft
    before it, then verified greedily (the draft tokens
    the model chooses itself, then its own choice) or by rejection sampling
    (``verify_sampled``); with the logprobs of the raw logits where the row asked."""
    import torch  # NOTE: here, not above: engine.config imports this module, torch-free

    from engine.sampler import shape_logits, token_logprobs

    params, draft = req.sampling, req.draft
    rows = logits
    if params.shapes_logits or req.grammar is not None:
        rows = logits.float().clone()
    if params.shapes_logits:
        for j in range(len(draft) + 1):
            shape_logits(rows[j], params, req.history + draft[:j], req.num_prompt_tokens)
    if req.grammar is not None:
        from engine.grammar import apply_bitmasks  # NOTE: xgrammar loads on first use only

        # The draft is one the grammar accepts (the scheduler cut it short); its state is
        # only walked along it and back: it advances with the tokens kept, afterwards.
        apply_bitmasks(rows, req.grammar.fill_along(draft))
    if params.greedy:
        chosen = torch.argmax(rows, dim=-1).tolist()
        kept = accepted_prefix(draft, chosen)
        tokens = draft[:kept] + [chosen[kept]]
    else:
        tokens = verify_sampled(rows, draft, params, req.seed, req.num_output_tokens)
    out = Speculated(tokens)
    if params.logprobs is not None:
        out.logprobs = [token_logprobs(logits[j], t, params.logprobs)
                        for j, t in enumerate(tokens)]
    if req.sampled_logprob:
        raw = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
        out.sampled_logprobs = [float(raw[j, t]) for j, t in enumerate(tokens)]
    return out


def accepted_prefix(draft: list[int], chosen: list[int]) -> int:
    """How many leading draft tokens the model chose itself (``chosen[i]``: its choice
    at draft position i, one more than the draft)."""
    a = 0
    while a < len(draft) and draft[a] == chosen[a]:
        a += 1
    return a


class SequenceDrafts:
    """One sequence's speculation: its n-gram index and its draft length.

    The index maps each token to the positions it occurs at, filled as the sequence grows
    (token_ids only ever grows, recomputation included), so a proposal checks the latest
    ``MAX_CANDIDATES`` earlier occurrences of the last token, not the whole sequence: a
    32k-token prompt costs no more per step than a short one.

    The draft length grows by one after a fully accepted draft and shrinks to what was
    accepted plus one after a rejection, between 1 and ``limit``.
    """

    __slots__ = ("limit", "length", "_positions", "_indexed")

    def __init__(self, limit: int) -> None:
        self.limit = self.length = limit
        self._positions: dict[int, list[int]] = {}
        self._indexed = 0  # tokens before this position are in _positions

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``tokens`` (``MAX_NGRAM`` down to ``MIN_NGRAM`` tokens) found in it."""
        last = len(tokens) - 1
        for i in range(self._indexed, last):
            self._positions.setdefault(tokens[i], []).append(i)
        self._indexed = max(self._indexed, last)
        if k <= 0 or last < 1:
            return []
        best_n, best_at = 0, -1
        for at in reversed(self._positions.get(tokens[last], [])[-MAX_CANDIDATES:]):
            n = 1
            while n < MAX_NGRAM and at - n >= 0 and tokens[at - n] == tokens[last - n]:
                n += 1
            if n > best_n:
                best_n, best_at = n, at
                if n == MAX_NGRAM:
                    break
        if best_n < MIN_NGRAM:
            return []
        return tokens[best_at + 1:best_at + 1 + k]

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted == proposed:
            self.length = min(self.limit, self.length + 1)
        else:
            self.length = max(1, accepted + 1)


class SpeculationGovernor:
    """Keeps speculation on only while it pays: decode steps with it must yield more tokens
    per second per sequence than steps without it, and a losing way costs little.

    Both are measured as the engine runs (an exponential average each). It learns first,
    alternating until it has ``MIN_SAMPLES`` comparable steps each way, then keeps the
    faster way and probes the other now and then: the first probe ``PROBE_FIRST``
    comparable steps after a change of mind; each probe that confirms the choice at least
    doubles the wait, and makes it long enough that the probe's extra time is at most
    ``LOSS_BUDGET`` of the steps until the next, up to ``PROBE_MOST``. So a proposer that
    costs more than it saves (a draft model whose passes cost as much as the target's, and
    whose cache must first read what it skipped) costs a few learning steps and then about
    1% at most, and a change of conditions (a workload that starts repeating itself) is seen
    within ``PROBE_MOST`` steps. A probe's
    sample weighs more (``PROBE_ALPHA``) than a step of the way kept (``ALPHA``): it is
    one of few. Comparable steps: only decodes (no prompt chunks), few enough rows to
    speculate at all.
    """

    PROBE_FIRST = 8
    PROBE_MOST = 1024
    LOSS_BUDGET = 0.01  # what probes may cost, as a share of the steps between them
    ALPHA = 0.1
    PROBE_ALPHA = 0.5
    MIN_SAMPLES = 3  # of each way before deciding: a first step's warm-up decides nothing

    def __init__(self) -> None:
        self.on = True
        self.rate: dict[bool, float | None] = {True: None, False: None}
        self._samples = {True: 0, False: 0}
        self._wait = self.PROBE_FIRST  # comparable steps between probes now
        self._until_probe = self.PROBE_FIRST
        self._asked = True  # what the last wants_drafts answered

    @property
    def learning(self) -> bool:
        return min(self._samples.values()) < self.MIN_SAMPLES

    def wants_drafts(self) -> bool:
        """Whether the next step proposes drafts. NOTE: a probe that falls on a step that
        is not comparable, or a probe for drafts on a step where none was proposed, stays
        due until one is."""
        if self.learning:
            self._asked = self._samples[True] <= self._samples[False]
        else:
            self._asked = (not self.on) if self._until_probe <= 0 else self.on
        return self._asked

    def record(self, *, drafting: bool, rows: int, tokens: int, seconds: float) -> None:
        """A comparable step: ``rows`` decoding sequences yielded ``tokens`` in ``seconds``
        (the draft model's proposals included); ``drafting``: whether any row had a draft.
        NOTE: a step asked to draft where no row had one (no n-gram found) is a step
        without drafts: it tells what those cost."""
        if rows <= 0 or seconds <= 0:
            return
        learning = self.learning
        probe = not learning and self._asked != self.on and drafting == self._asked
        rate, old = tokens / seconds / rows, self.rate[drafting]
        alpha = self.PROBE_ALPHA if probe and not learning else self.ALPHA
        self.rate[drafting] = rate if old is None else old + alpha * (rate - old)
        self._samples[drafting] += 1
        if self.learning:
            return
        choice = self.rate[True] >= self.rate[False]
        if learning or choice != self.on:  # decided for the first time, or changed its mind
            self._wait = self.PROBE_FIRST
        elif probe:  # the probe confirmed the choice: wait longer, long enough for its cost
            cost = self.rate[self.on] / rate - 1  # the probe step's, in kept steps
            self._wait = min(self.PROBE_MOST, max(2 * self._wait,
                                                  math.ceil(cost / self.LOSS_BUDGET)))
        if learning or probe or choice != self.on:
            self._until_probe = self._wait
        elif self._asked == self.on:
            self._until_probe -= 1
        self.on = choice


def verify_sampled(logits: torch.Tensor, draft: list[int], params: SamplingParams, seed: int,
                   step: int) -> list[int]:
    """The tokens a sampled (temperature > 0) row yields from its logits [len(draft) + 1,
    vocab]: rejection sampling, so each token has exactly the distribution it has without
    speculation. ``step``: the index of the row's first new output token (its random
    stream, engine/seeds.py).

    A draft token x comes from a proposer that puts all its probability on x, so it is
    kept with probability p(x) under the model's distribution p at its position; when it
    is not, the position's token is drawn from p without x (renormalised), and the draft
    ends there. After a fully kept draft, the next token is drawn from p as usual.
    """
    import torch  # NOTE: here, not above: engine.config imports this module, torch-free

    from engine.sampler import generator_for, probabilities

    out = []
    for j, token in enumerate(draft):
        probs = probabilities(logits[j], params)
        generator = generator_for(seed, step + j, logits.device)
        if float(torch.rand(1, generator=generator, device=logits.device)) < float(probs[token]):
            out.append(token)
            continue
        rest = probs.clone()
        rest[token] = 0.0
        out.append(int(torch.multinomial(rest / rest.sum(), 1, generator=generator)))
        return out
    probs = probabilities(logits[len(draft)], params)
    out.append(int(torch.multinomial(probs, 1, generator=generator_for(
        seed, step + len(draft), logits.device))))
    return out
