"""What an engine hands the worker each step, and the interface the worker drives.

The reference engine (reference.py) and the continuous-batching engine both
speak this; the worker (worker.py) knows nothing else about them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from engine import protocol
from engine.batch import PromptLogprob, TokenLogprobs


@dataclass(slots=True)
class Usage:
    # NOTE: prompt_tokens counts prompt tokens the engine actually ran (0 when a request
    # ends before its prefill): billing charges for work done.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_s: float = 0.0  # added to the engine → first scheduled
    ttft_s: float | None = None  # added to the engine → first output token
    total_s: float = 0.0  # added to the engine → finished
    adapter_wait_s: float | None = None  # added to the engine → its adapter loaded (if it waited)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one step: new text and tokens, and how it ended."""

    request_id: str
    text_delta: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when asked for
    finished: bool = False
    finish_reason: str | None = None  # protocol.FINISH_* or None while running / on error
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    usage: Usage | None = None  # set on the final output
    error: str | None = None  # set when the engine failed this request
    error_code: str | None = None  # protocol.ERROR_*; default: the worker's (engine_error)
    # More than one choice: the choice the text and tokens belong to; on the final output,
    # how every choice ended ({"index", "finish_reason", "cumulative_logprob"} each).
    index: int = 0
    choices: list[dict[str, Any]] | None = None
    # Asked for (prompt_logprobs), once, on the first output of each prompt's own choice
    # (p * n) after its prompt ran: one per prompt token after the first ([] for a 1-token
    # prompt).
    prompt_logprobs: list[PromptLogprob] | None = None
    # An embed request's final output (finish_reason "stop"): each input's vector, base64
    # of little-endian float32, in input order (protocol.EV_FINISH).
    embeddings: list[str] | None = None


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput | None:
    """One step's outputs of one sequence as one: their text and tokens in order, and how
    the last one ended."""
    if len(outputs) <= 1:
        return outputs[0] if outputs else None
    last = outputs[-1]
    last.text_delta = "".join(out.text_delta for out in outputs)
    last.token_ids = [t for out in outputs for t in out.token_ids]
    # NOTE: only a step's last token can lack logprobs (an EOS or stop token ends it), so
    # the list stays aligned with token_ids, as the platform reads it.
    logprobs = [out.logprobs for out in outputs if out.logprobs is not None]
    last.logprobs = [lp for group in logprobs for lp in group] if logprobs else None
    return last


class EngineCore(Protocol):
    """The engine interface the worker drives, one ``step()`` at a time."""

    def add_request(self, request: protocol.EngineRequest) -> None:
        """Queues a request; raises ValueError when it can never run (the worker reports it)."""

    def abort_request(self, request_id: str, reason: str) -> RequestOutput | None:
        """Drops a queued or running request; its final output, or None if unknown."""

    def has_unfinished(self) -> bool: ...

    def num_running(self) -> int: ...

    def num_waiting(self) -> int: ...

    def room(self) -> int:
        """How many more requests the worker may read from Redis and hand over now."""

    def lane_room(self, lane: str) -> int:
        """How many more requests of a service tiers' lane (protocol.LANES) it may hand
        over now: each lane has a room of its own."""

    def step(self) -> list[RequestOutput]: ...

    def forget_adapter(self, adapter_hash: str) -> None:
        """The platform deleted this adapter: let go of it wherever nothing still uses it."""

    def placement(self) -> dict[str, Any]:
        """What the web tier places requests by (inference/routing.py); {}: nothing."""

    def resident_adapters(self) -> list[str]:
        """The adapters in host memory or loading into it, sorted (the placement's)."""

    def snapshot(self) -> dict[str, Any] | None:
        """Everything the heartbeat carries and Prometheus exports; None: no metrics."""


class PlainEngine:
    """The parts of EngineCore an engine without adapters, placement hints or metrics
    answers alike (the reference engine, and the test and benchmark engines)."""

    def forget_adapter(self, adapter_hash: str) -> None:
        return None

    def lane_room(self, lane: str) -> int:
        return self.room()  # NOTE: a FIFO engine has no room of its own for a lane

    def placement(self) -> dict[str, Any]:
        return {}

    def resident_adapters(self) -> list[str]:
        return []

    def snapshot(self) -> dict[str, Any] | None:
        return None
