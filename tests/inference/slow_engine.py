"""A real continuous-batching engine slowed down and told to ignore EOS, so tests can act
mid-stream while several requests generate at once."""

from __future__ import annotations

import time
from pathlib import Path


class SlowEngine:
    def __init__(self, inner, step_s: float) -> None:
        self.inner = inner
        self.step_s = step_s
        self.steps = 0

    def add_request(self, request) -> None:
        request.sampling.ignore_eos = True
        self.inner.add_request(request)

    def step(self):
        time.sleep(self.step_s)
        self.steps += 1
        return self.inner.step()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def slow_factory(step_s: float):
    def factory(model_dir: Path):
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine

        return SlowEngine(LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=512)),
                          step_s)

    return factory
