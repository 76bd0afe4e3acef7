"""Structured output: compiling response formats to token grammars, and masking logits by them.

The platform sends a response format as a plain dict, ``{"type": "json_object"}`` or
``{"type": "json_schema", "schema": {...}}``. ``Grammars`` (one per model, owned by the
engine) compiles it with xgrammar on its own threads, so a slow schema never stalls a step;
``GrammarState`` follows one sequence through its grammar; ``apply_grammars`` masks one
batch's logits in place. The runner owns the tensors; the scheduler only sees the states.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from engine.compile_turns import CompileTurns
from engine.json_schema_support import first_problem

PARAM = "response_format"

# NOTE: json_object is the schema {"type": "object"} rather than xgrammar's builtin JSON
# grammar: the builtin one also admits arrays and unbounded whitespace, so an untrained model
# could answer "[" or pad with spaces until max_tokens. This one admits any object, compactly.
_JSON_OBJECT = '{"type": "object"}'
_LOOSE_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = (r'([^\0-\x1f\"\\] | ("\\" ([\"\\/bfnrt] | ("u" [A-Fa-f0-9] [A-Fa-f0-9] '
               r'[A-Fa-f0-9] [A-Fa-f0-9]))))')
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")


class GrammarError(ValueError):
    """A response format the engine cannot compile or enforce: the client's mistake (a 400)."""


def spec_key(spec: Any) -> str:
    """The cache key of a response format: the sha256 of its canonical JSON."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _tokenizer_info(model_dir: Path, vocab_size: int,
                    stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """The model's vocabulary as xgrammar sees it, with special tokens blanked.

    xgrammar reads a token's text, not its ``special`` flag, so ``<|user|>`` would be a valid
    piece of a JSON string. An empty entry makes it a special token, which no grammar admits;
    the stop tokens stay allowed where the grammar ends, by their ids.
    """
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    encoded = [""] * vocab_size
    for text, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            encoded[token_id] = text
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids,
                             add_prefix_space=detected.add_prefix_space)


class Utf8Guard:
    """Keeps a grammar's output decodable: no UTF-16 surrogate (U+D800..U+DFFF) in its bytes.

    NOTE: xgrammar's "any character" (a negated class, a regex's dot) admits the three-byte
    forms of surrogates, ED A0 80..ED BF BF, which no UTF-8 decoder accepts: the text shows
    three U+FFFD where the grammar counted one character, so a string of maxLength 8 came out
    10 long. A token holding ED then A0..BF is never allowed; after a token ending in the lead
    byte ED (it is never a continuation byte), tokens starting with A0..BF are not allowed.
    """

    __slots__ = ("ends_in_lead", "_refused", "_refused_after_lead", "_always", "_after_lead")

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int) -> None:
        self.ends_in_lead = [token.endswith(b"\xed") for token in decoded_vocab]
        always = [i for i, token in enumerate(decoded_vocab) if _holds_surrogate(token)]
        after = [i for i, token in enumerate(decoded_vocab) if token and 0xA0 <= token[0] <= 0xBF]
        self._refused = frozenset(always)
        self._refused_after_lead = frozenset(always + after)
        # None: nothing to clear (most vocabularies hold no surrogate bytes in one token).
        self._always = _allowed_but(always, vocab_size) if always else None
        self._after_lead = _allowed_but(always + after, vocab_size)

    def refuses(self, after_lead: bool, token_id: int) -> bool:
        """Whether ``token_id`` would put a surrogate in the output."""
        return token_id in (self._refused_after_lead if after_lead else self._refused)

    def restrict(self, bitmask: torch.Tensor, row: int, after_lead: bool) -> None:
        """Clears the tokens ``refuses`` from ``bitmask[row]``, in place."""
        words = self._after_lead if after_lead else self._always
        if words is not None:
            bitmask[row] &= words


def _holds_surrogate(token: bytes) -> bool:
    return any(token[i] == 0xED and 0xA0 <= token[i + 1] <= 0xBF
               for i in range(len(token) - 1))


def _allowed_but(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """An xgrammar bitmask row (int32 words, bit set = allowed) of every token but these."""
    bits = torch.ones(((vocab_size + 31) // 32) * 32, dtype=torch.bool)
    bits[list(token_ids)] = False
    weights = (1 << torch.arange(32, dtype=torch.int64))
    words = (bits.view(-1, 32).to(torch.int64) * weights).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class GrammarState:
    """One sequence's place in its grammar; the runner masks by it, the scheduler feeds it.

    ``_lead`` holds, per accepted token, whether it ended in an unfinished ED (Utf8Guard):
    rollbacks pop it with the matcher."""

    __slots__ = ("_matcher", "_guard", "_lead", "vocab_size")

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int,
                 guard: Utf8Guard) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._guard = guard
        self._lead: list[bool] = []
        self.vocab_size = vocab_size

    def fork(self) -> GrammarState:
        """An independent state at the same place (another choice of the same request)."""
        state = GrammarState.__new__(GrammarState)
        state._matcher = self._matcher.fork()
        state._guard = self._guard
        state._lead = list(self._lead)
        state.vocab_size = self.vocab_size
        return state

    def accept(self, token_id: int) -> bool:
        """Advances by one sampled token; False (state unchanged) if the grammar forbids it."""
        if self._guard.refuses(self._after_lead, token_id) \
                or not self._matcher.accept_token(token_id):
            return False
        self._lead.append(self._guard.ends_in_lead[token_id])
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens (speculative or preempted work)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._lead[-num_tokens:]

    def accepts_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts in order (a draft's part worth
        verifying), a stop token not among them; the state is left where it was."""
        if self._matcher.is_terminated():
            return 0
        taken = 0
        for token in tokens:
            if not self.accept(token):
                break
            taken += 1
            if self._matcher.is_terminated():
                break
        ended = self._matcher.is_terminated()
        self.rollback(taken)
        # NOTE: a stop token is not verified: no mask follows it, and the model's own sample
        # at that position may still end the text there.
        return taken - 1 if ended else taken

    def fill_along(self, tokens: Sequence[int]) -> FilledMasks:
        """The allowed tokens at each position of a draft the grammar accepts: before
        ``tokens[0]``, after it, ..., after the last ([len(tokens) + 1] rows); the state is
        left where it was (rolled back)."""
        bitmask = xgr.allocate_token_bitmask(len(tokens) + 1, self.vocab_size)
        for row, token in enumerate(tokens):
            self.fill(bitmask, row)
            if not self.accept(token):
                self.rollback(row)
                raise ValueError("a draft the grammar refuses was not cut short")
        self.fill(bitmask, len(tokens))
        self.rollback(len(tokens))
        return FilledMasks(bitmask, list(range(len(tokens) + 1)))

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (one bit per token)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._guard.restrict(bitmask, row, self._after_lead)

    @property
    def _after_lead(self) -> bool:
        return bool(self._lead) and self._lead[-1]


@dataclass(slots=True)
class FilledMasks:
    """The token bitmasks of one step's constrained rows: [rows, ceil(vocab / 32)]."""

    bitmask: torch.Tensor
    rows: list[int]  # the rows that have a grammar


def fill_bitmasks(states: Sequence[GrammarState | None], vocab_size: int
                  ) -> FilledMasks | None:
    """Each constrained row's mask of allowed tokens; None when no row has a grammar.

    NOTE: the slow half of a grammar's cost, and xgrammar releases the GIL while it fills:
    the model runner calls this on a thread while the forward pass runs.
    """
    constrained = [(row, state) for row, state in enumerate(states) if state is not None]
    if not constrained:
        return None
    if any(state.vocab_size != vocab_size for _, state in constrained):
        raise ValueError(f"logits are {vocab_size} wide, the grammars' vocabulary is not")
    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)  # [rows, ceil(vocab / 32)]
    for row, state in constrained:
        state.fill(bitmask, row)
    return FilledMasks(bitmask, [row for row, _ in constrained])


def apply_bitmasks(logits: torch.Tensor, masks: FilledMasks | None) -> None:
    """Sets every token a row's mask forbids to -inf, in place (``logits`` [rows, vocab])."""
    if masks is None:
        return
    if logits.dim() != 2 or logits.shape[0] != masks.bitmask.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} do not match "
                         f"{masks.bitmask.shape[0]} masks")
    xgr.apply_token_bitmask_inplace(logits, masks.bitmask.to(logits.device, non_blocking=True),
                                    indices=masks.rows)


def apply_grammars(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Sets every token a row's grammar forbids to -inf, in place; rows with None stay as they are.

    ``logits`` is [rows, vocab]; its width must be the ``vocab_size`` the grammars were built
    for (the model's logits width, padding included: padded ids are never allowed).
    """
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
    apply_bitmasks(logits, fill_bitmasks(states, logits.shape[-1]))


class Grammars:
    """Compiles response formats for one model, off the caller's thread, and keeps the results.

    NOTE: the cache is keyed by tenant and spec, not by tokenizer: it is fixed per instance:
    a compiled grammar embeds the vocabulary it was built for, so a second model needs its
    own ``Grammars``. ``hits`` counts submits answered by a cached or in-flight compile,
    ``misses`` the compiles started.
    """

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: Iterable[int], *,
                 cache_size: int = 128, threads: int = 2) -> None:
        if cache_size < 1 or threads < 1:
            raise ValueError("cache_size and threads must be at least 1")
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        info = _tokenizer_info(Path(model_dir), vocab_size, sorted(set(stop_token_ids)))
        self._guard = Utf8Guard(info.decoded_vocab, vocab_size)
        # NOTE: xgrammar's own cache is off: ours bounds memory by entries and dedups in flight.
        # One thread per compile (xgrammar's own threads would not be niced, and one
        # tenant's schema could take every core); compiles run side by side on our threads,
        # in per-tenant turns, so one tenant's slow schemas never queue in front of
        # another's (engine/compile_turns.py).
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._pool = CompileTurns(threads)
        self._lock = threading.RLock()  # a cancel's callback takes it again
        self._futures: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        # Requests waiting on each compile not yet done (abandon drops one no one awaits).
        self._waiters: dict[Future[xgr.CompiledGrammar], int] = {}
        self.hits = 0
        self.misses = 0
        self.compiles = 0
        self.last_compile_seconds = 0.0

    def submit(self, spec: dict[str, Any], *, tenant: str = ""
               ) -> Future[xgr.CompiledGrammar]:
        """A future of the compiled grammar, raising GrammarError if the spec is refused;
        compiled in ``tenant``'s turn.

        A tenant's identical specs get the same future, whether it is done or still
        compiling. NOTE: per tenant, as the prefix cache is: another tenant's compile, still
        queued in that tenant's turn, would hold this one's request behind it (and a hit
        would tell one tenant what another asked for).
        """
        try:
            key = f"{tenant}:{spec_key(spec)}"
        except (TypeError, ValueError) as error:
            failed: Future[xgr.CompiledGrammar] = Future()
            failed.set_exception(GrammarError(f"{PARAM}: not JSON: {error}"))
            return failed
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                self.hits += 1
                if future in self._waiters:
                    self._waiters[future] += 1
                return future
            self.misses += 1
            future = self._pool.submit(tenant, self._compile, spec)
            self._futures[key] = future
            self._waiters[future] = 1
            while len(self._futures) > self.cache_size:
                self._futures.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_failure(key, done))
        return future

    def abandon(self, future: Future[xgr.CompiledGrammar]) -> None:
        """A request waiting on ``future`` is gone (cancelled, its client away): a compile
        no one waits for any more is dropped while it is still queued, so an abandoned
        request costs the compile threads nothing."""
        with self._lock:  # NOTE: held while cancelling: no submit may take it meanwhile
            if future not in self._waiters:
                return
            self._waiters[future] -= 1
            if self._waiters[future] > 0:
                return
            del self._waiters[future]
            future.cancel()  # no effect once it runs: it then finishes and is kept

    def state(self, compiled: xgr.CompiledGrammar) -> GrammarState:
        """A fresh matcher at the start of ``compiled``, for one sequence."""
        return GrammarState(compiled, self.vocab_size, self._guard)

    def close(self) -> None:
        """Stops the compile threads; compiles already running finish first."""
        self._pool.close()

    def _forget_failure(self, key: str, future: Future[xgr.CompiledGrammar]) -> None:
        """A refused spec is not kept: the LRU holds grammars, and the error is cheap to redo.
        A dropped one neither: the next request for it compiles it."""
        with self._lock:
            self._waiters.pop(future, None)
            if (future.cancelled() or future.exception() is not None) and \
                    self._futures.get(key) is future:
                del self._futures[key]

    def _compile(self, spec: dict[str, Any]) -> xgr.CompiledGrammar:
        schema = _schema_text(spec)
        started = time.perf_counter()
        try:
            compiled = self._compile_schema(schema)
        except (RuntimeError, ValueError) as error:
            raise GrammarError(f"{PARAM}.json_schema: {_reason(error)}") from None
        elapsed = time.perf_counter() - started
        with self._lock:
            self.compiles += 1
            self.last_compile_seconds = elapsed
        return compiled


    def _compile_schema(self, schema: str) -> xgr.CompiledGrammar:
        """Compact (any_whitespace=False) and strict, so even an untrained model closes the JSON.

        NOTE: xgrammar 0.2.8 writes a length-bounded string's character as "anything but a
        quote, a backslash, CR or LF": it admits the raw control characters JSON forbids and
        no escape at all. It is swapped for JSON's character (an escape counts as one, as the
        schema counts it); tests/engine/test_grammar.py fails if the swap stops applying.
        """
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        text = str(grammar)
        if _LOOSE_CHARS not in text:
            return self._compiler.compile_grammar(grammar)
        return self._compiler.compile_grammar(text.replace(_LOOSE_CHARS, _JSON_CHARS))


def _schema_text(spec: Any) -> str:
    """The JSON schema a spec stands for, once it passed the checks the platform also runs."""
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "json_object":
        return _JSON_OBJECT
    if kind != "json_schema":
        raise GrammarError(f"{PARAM}.type must be 'json_object' or 'json_schema', not {kind!r}")
    if "schema" not in spec:
        raise GrammarError(f"{PARAM}.json_schema: 'schema' is required")
    problem = first_problem(spec["schema"])
    if problem is not None:
        raise GrammarError(f"{PARAM}.json_schema: {problem.message}"
                           + (f" (at {problem.path})" if problem.path else ""))
    return json.dumps(spec["schema"])


def _reason(error: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    lines = str(error).strip().splitlines() or [repr(error)]
    return _CPP_PREFIX.sub("", lines[0])
