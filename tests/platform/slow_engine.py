"""A real reference engine slowed down and told to ignore EOS, so tests can act mid-stream."""

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
        from engine.reference import ReferenceEngine

        return SlowEngine(ReferenceEngine(model_dir), step_s)

    return factory
