"""How one request is sampled and when it stops (vLLM's SamplingParams, trimmed)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine import protocol

# Temperatures below this sample greedily: dividing logits by a tinier one overflows.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_N = 16  # choices per prompt


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # OpenAI's penalties over the output so far: presence once per seen token, frequency
    # per occurrence, subtracted from the logit. Hugging Face's repetition penalty over
    # prompt and output: a seen token's positive logit divided by it, a negative multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many are out
    stop_token_ids: list[int] = field(default_factory=list)  # end like EOS, not in the text
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k
    # None: none; k: each prompt token's after the first, its rank, and the top k there.
    prompt_logprobs: int | None = None
    n: int = 1  # choices from each prompt (engine/parallel.py)
    # Set by the engine: the tokens min_tokens holds back (its EOS ids and stop_token_ids).
    min_tokens_masked: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.stop, list | tuple) \
                or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        self.stop = list(self.stop)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self._check_penalties()
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}]")
        self.stop_token_ids = list(self.stop_token_ids)
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")

    def _check_penalties(self) -> None:
        for name, low, high in (("presence_penalty", -2.0, 2.0),
                                ("frequency_penalty", -2.0, 2.0),
                                ("repetition_penalty", 0.0, 2.0)):
            value = getattr(self, name)
            if not _is_number(value) or not low <= value <= high or (
                    name == "repetition_penalty" and value == 0):
                raise ValueError(f"{name} must be a number in "
                                 f"{'(' if low == 0 else '['}{low}, {high}], got {value!r}")
            setattr(self, name, float(value))
        if not isinstance(self.logit_bias, dict) or not all(
                _is_int(k) and k >= 0 and _is_number(v) and -100 <= v <= 100
                for k, v in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids to numbers in [-100, 100]")
        self.logit_bias = {k: float(v) for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but temperature/top-k/top-p changes this row's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    @classmethod
    def from_spec(cls, spec: protocol.SamplingSpec) -> SamplingParams:
        try:
            bias = {int(k): v for k, v in spec.logit_bias.items()}
        except (TypeError, ValueError):
            raise ValueError("logit_bias keys must be token ids") from None
        return cls(max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                   top_k=spec.top_k, seed=spec.seed, stop=list(spec.stop),
                   ignore_eos=spec.ignore_eos, presence_penalty=spec.presence_penalty,
                   frequency_penalty=spec.frequency_penalty,
                   repetition_penalty=spec.repetition_penalty, logit_bias=bias,
                   min_tokens=spec.min_tokens, stop_token_ids=list(spec.stop_token_ids),
                   logprobs=spec.logprobs, prompt_logprobs=spec.prompt_logprobs, n=spec.n)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value)
