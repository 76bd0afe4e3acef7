"""The Hugging Face transformers reference engine: one request at a time.

It is slow on purpose and simple on purpose: a manual token-by-token loop over
``past_key_values`` so every step can be cancelled, and the oracle that later
engines (continuous batching, paged KV, LoRA) are tested against.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from engine import protocol
from engine.batch import PromptLogprob
from engine.config import eos_token_ids
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import PlainEngine, RequestOutput, Usage
from engine.sampler import sample, shape_logits, token_logprobs
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Active:
    request: protocol.EngineRequest
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    seed: int
    added_at: float  # time.monotonic()
    scheduled_at: float | None = None
    first_token_at: float | None = None
    past_key_values: Any = None  # the model's KV cache once the prompt has run
    output_ids: list[int] = field(default_factory=list)


class ReferenceEngine(PlainEngine):
    """Runs requests FIFO, one forward pass per ``step()`` (prefill or one decode token)."""

    def __init__(self, model_dir: Path | str, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model.to(self.device).eval()
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = self.model.config
        self.vocab_size: int = config.vocab_size
        self.max_model_len: int = config.max_position_embeddings
        self.eos_token_ids = eos_token_ids(model_dir)
        self.waiting: deque[_Active] = deque()
        self.running: _Active | None = None

    def add_request(self, request: protocol.EngineRequest) -> None:
        if request.task != protocol.TASK_GENERATE:
            raise ValueError(f"model {request.model} does not serve embeddings (not on the "
                             f"reference engine)")
        params = SamplingParams.from_spec(request.sampling)
        params.min_tokens_masked = frozenset(self.eos_token_ids | set(params.stop_token_ids))
        prompt = request.prompt_token_ids
        if params.n != 1:
            raise ValueError(f"n={params.n}: the reference engine generates one choice per "
                             f"request")
        if request.extra_prompts:
            raise ValueError(f"{1 + len(request.extra_prompts)} prompts: the reference engine "
                             f"runs one prompt per request")
        if request.sampling.grammar is not None:
            raise ValueError("response_format cannot be enforced: the reference engine "
                             "serves no grammars")
        if not prompt:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context "
                             f"holds {self.max_model_len} including the output")
        if self._find(request.request_id) is not None:
            raise ValueError(f"request {request.request_id} is already in the engine")
        if request.adapter_hash is not None or request.adapter:
            # NOTE: refused, never answered by the base model as if it were the adapter.
            raise ValueError(f"adapter {request.adapter or request.adapter_hash} cannot be "
                             f"served: the reference engine runs the base model only")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.waiting.append(_Active(
            request=request, params=params, seed=seed, added_at=time.monotonic(),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop)))

    def abort_request(self, request_id: str, reason: str) -> RequestOutput | None:
        active = self._find(request_id)
        if active is None:
            return None
        if active is self.running:
            self.running = None
        else:
            self.waiting.remove(active)
        return self._final(active, reason, text=active.detokenizer.flush())

    def has_unfinished(self) -> bool:
        return self.running is not None or bool(self.waiting)

    def num_running(self) -> int:
        return int(self.running is not None)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def room(self) -> int:
        return max(0, 1 - len(self.waiting))  # one waiting behind the one running

    def step(self) -> list[RequestOutput]:
        outputs = self._expire_waiting()
        if self.running is None and self.waiting:
            self.running = self.waiting.popleft()
            self.running.scheduled_at = time.monotonic()
        active = self.running
        if active is None:
            return outputs
        deadline = active.request.deadline
        if deadline is not None and time.time() >= deadline:
            self.running = None
            outputs.append(self._final(active, protocol.FINISH_DEADLINE,
                                       text=active.detokenizer.flush()))
            return outputs
        try:
            output = self._advance(active)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the engine
            log.exception("request %s failed in the reference engine", active.request.request_id)
            output = self._final(active, None, error=f"{type(exc).__name__}: {exc}"[:500])
        if output.finished:
            self.running = None
        outputs.append(output)
        return outputs

    @torch.inference_mode()
    def _advance(self, active: _Active) -> RequestOutput:
        params = active.params
        prompt = active.request.prompt_token_ids
        prefill = active.past_key_values is None
        if prefill:
            input_ids = torch.tensor([prompt])  # [1, prompt_len]
        else:
            input_ids = torch.tensor([active.output_ids[-1:]])  # [1, 1]
        every = prefill and params.prompt_logprobs is not None  # 0 keeps every position's
        out = self.model(input_ids=input_ids.to(self.device), use_cache=True,
                         past_key_values=active.past_key_values, logits_to_keep=0 if every else 1)
        active.past_key_values = out.past_key_values
        logits = out.logits[0, -1].float()  # [vocab]
        prompt_lps = None if not every else \
            prompt_logprobs(out.logits[0, :-1].float(), prompt[1:], params.prompt_logprobs)
        shaped = logits.clone()
        if params.shapes_logits:
            shape_logits(shaped, params, prompt + active.output_ids, len(prompt))
        token = sample(shaped, params, active.seed, len(active.output_ids))
        hidden = token in params.stop_token_ids or (token in self.eos_token_ids
                                                     and not params.ignore_eos)
        logprobs = None if params.logprobs is None or hidden else \
            [token_logprobs(logits, token, params.logprobs)]
        if active.first_token_at is None:
            active.first_token_at = time.monotonic()
        active.output_ids.append(token)
        text = "" if token in params.stop_token_ids else active.detokenizer.add_token(token)
        reason = self._finish_reason(active, token)
        if reason is None:
            return RequestOutput(active.request.request_id, text_delta=text, token_ids=[token],
                                 logprobs=logprobs, prompt_logprobs=prompt_lps)
        final = self._final(active, reason, text=text + active.detokenizer.flush(),
                            token_ids=[token])
        final.logprobs = logprobs
        final.prompt_logprobs = prompt_lps
        return final

    def _finish_reason(self, active: _Active, token: int) -> str | None:
        params = active.params
        if token in self.eos_token_ids and not params.ignore_eos:
            return protocol.FINISH_STOP
        if token in params.stop_token_ids or active.detokenizer.stopped:
            return protocol.FINISH_STOP
        if len(active.output_ids) >= params.max_tokens:
            return protocol.FINISH_LENGTH
        if len(active.request.prompt_token_ids) + len(active.output_ids) >= self.max_model_len:
            return protocol.FINISH_LENGTH
        return None

    def _final(self, active: _Active, reason: str | None, *, text: str = "",
               token_ids: list[int] | None = None, error: str | None = None) -> RequestOutput:
        now = time.monotonic()
        ran_prompt = active.past_key_values is not None
        usage = Usage(
            prompt_tokens=len(active.request.prompt_token_ids) if ran_prompt else 0,
            completion_tokens=len(active.output_ids),
            queue_s=(active.scheduled_at or now) - active.added_at,
            ttft_s=None if active.first_token_at is None
            else active.first_token_at - active.added_at,
            total_s=now - active.added_at)
        active.past_key_values = None
        return RequestOutput(active.request.request_id, text_delta=text,
                             token_ids=token_ids or [], finished=True, finish_reason=reason,
                             usage=usage, error=error)

    def _expire_waiting(self) -> list[RequestOutput]:
        now = time.time()
        expired = [a for a in self.waiting
                   if a.request.deadline is not None and now >= a.request.deadline]
        for active in expired:
            self.waiting.remove(active)
        return [self._final(a, protocol.FINISH_DEADLINE) for a in expired]

    def _find(self, request_id: str) -> _Active | None:
        if self.running is not None and self.running.request.request_id == request_id:
            return self.running
        return next((a for a in self.waiting if a.request.request_id == request_id), None)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[PromptLogprob]:
    """Each target's logprob, rank and the k most likely tokens, from float32 ``logits``
    [len(targets), vocab] at the positions before each (raw: nothing shapes them)."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [targets, vocab]
    chosen = logprobs.gather(1, torch.tensor(targets, dtype=torch.long,
                                             device=logits.device)[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top = torch.topk(logprobs, k, dim=-1)
    return [PromptLogprob(value, rank, list(zip(ids, values, strict=True)))
            for value, rank, ids, values in zip(chosen[:, 0].tolist(), ranks,
                                                top.indices.tolist(), top.values.tolist(),
                                                strict=True)]


def generate_reference(model_dir: Path | str, prompts_token_ids: list[list[int]],
                       max_new_tokens: int) -> list[list[int]]:
    """Greedy output ids from Hugging Face ``generate``, one prompt at a time (no padding)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = sorted(eos_token_ids(Path(model_dir)))
    outputs = []
    with torch.inference_mode():
        for prompt in prompts_token_ids:
            input_ids = torch.tensor([prompt])  # [1, prompt_len]
            generated = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else None)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs
