"""An engine that answers with its prompt: secrets planted in a prompt reach the completion,
the events stream and everything downstream, as a model that repeats its input would.

It speaks the same EngineCore interface as the real engines and runs under the real
worker, so the Redis protocol, the relay and the platform are the code under test.
"""

from __future__ import annotations

import time
from pathlib import Path

from tokenizers import Tokenizer

from engine import protocol
from engine.outputs import PlainEngine, RequestOutput, Usage


class EchoEngine(PlainEngine):
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.waiting: list[tuple[protocol.EngineRequest, float]] = []

    def add_request(self, request: protocol.EngineRequest) -> None:
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.waiting.append((request, time.monotonic()))

    def abort_request(self, request_id: str, reason: str) -> RequestOutput | None:
        for item in self.waiting:
            if item[0].request_id == request_id:
                self.waiting.remove(item)
                return RequestOutput(request_id, finished=True, finish_reason=reason,
                                     usage=Usage())
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def num_running(self) -> int:
        return 0

    def num_waiting(self) -> int:
        return len(self.waiting)

    def room(self) -> int:
        return 8

    def step(self) -> list[RequestOutput]:
        outputs = []
        for request, added in self.waiting:
            ids = request.prompt_token_ids[:request.sampling.max_tokens]
            elapsed = time.monotonic() - added
            outputs.append(RequestOutput(
                request.request_id, text_delta=self.tokenizer.decode(ids),
                token_ids=list(ids), finished=True, finish_reason=protocol.FINISH_LENGTH,
                usage=Usage(prompt_tokens=len(request.prompt_token_ids),
                            completion_tokens=len(ids), queue_s=0.0, ttft_s=elapsed,
                            total_s=elapsed)))
        self.waiting.clear()
        return outputs


def echo_factory(model_dir: Path) -> EchoEngine:
    return EchoEngine(model_dir)
