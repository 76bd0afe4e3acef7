"""Embedding inputs: each one's vector, pooled from its final hidden states as it runs.

An embed request's inputs are sequences like prompts (one each, grouped as a request's
prompts are, engine/parallel.py): they batch with other requests' prefills and decodes
under the same token budget, in chunks, never sample, and end once their last chunk has
run. ``PooledInput`` is what one input carries from chunk to chunk (``Sequence.embedding``):
the runner adds each chunk's rows to it (``pool_rows``) and makes the vector at the last.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine import parallel, protocol
from engine.batch import SampleFailure, ScheduledRequest
from engine.outputs import RequestOutput
from engine.pooling import CLS, MEAN, Pooling
from engine.sequence import Sequence

NOT_FINITE = "the model produced an embedding that is not finite (NaN or infinite)"


@dataclass(slots=True, eq=False)
class PooledInput:
    pooling: Pooling
    # The chunks run so far, on the device: MEAN, the float32 sum of their rows; CLS, row
    # 0's; [hidden]. Dropped once the vector is made.
    partial: Any = None
    vector: bytes | None = None  # little-endian float32, once the last chunk has run

    def encoded(self) -> str:
        """The vector as the wire carries it (protocol.EV_FINISH, "embeddings")."""
        if self.vector is None:
            raise ValueError("the input's vector is not made yet")
        return base64.b64encode(self.vector).decode("ascii")


def start_inputs(seq: Sequence, extra: list[list[int]], pooling: Pooling) -> list[Sequence]:
    """Makes ``seq`` (input 0's sequence, not yet queued) an embed request's, with a
    sequence for each of ``extra``; returns every input's sequence, in input order."""
    if extra:
        parallel.start_group(seq, 1, extra)
    inputs = parallel.prompts_of(seq)
    for member in inputs:
        member.embedding = PooledInput(pooling)
    return inputs


def settle(outputs: list[RequestOutput | None], requests: dict[str, list[Sequence]]
           ) -> list[RequestOutput | None]:
    """Embed requests' outputs as the wire has them: only the final one (an input that ends
    while others run says nothing), which carries every input's vector when the request
    finished "stop". ``requests``: each open embed request's inputs; the ended leave it."""
    settled = []
    for out in outputs:
        inputs = requests.get(out.request_id) if out is not None else None
        if inputs is not None:
            if not out.finished:
                continue
            del requests[out.request_id]
            out.choices, out.index = None, 0  # one vector per input, no choices
            if out.error is None and out.finish_reason == protocol.FINISH_STOP:
                out.embeddings = [member.embedding.encoded() for member in inputs]
        settled.append(out)
    return settled


def pool_rows(hidden: torch.Tensor, reqs: list[ScheduledRequest], last_row: dict[int, int],
              sampled: list[Any]) -> None:
    """Adds each embedding row's chunk (``hidden`` [tokens, hidden], the final norm's output)
    to its input's pooling, and makes the vector of each input whose last chunk this is; a
    row whose vector is not finite fails (a ``SampleFailure`` in ``sampled``, the runner's
    output)."""
    made: list[tuple[int, torch.Tensor]] = []
    for i, req in enumerate(reqs):
        state: PooledInput | None = req.embedding
        if state is None:
            continue
        last = last_row[i]
        rows = hidden[last - len(req.token_ids) + 1:last + 1]  # [chunk, hidden]
        mode = state.pooling.mode
        if req.start_pos == 0:
            # NOTE: an input preempted mid-way runs again from its first token.
            state.partial = None
        if mode == MEAN:
            chunk = rows.float().sum(dim=0)  # [hidden]
            state.partial = chunk if state.partial is None else state.partial + chunk
        elif mode == CLS and req.start_pos == 0:
            state.partial = rows[0].float()
        if req.sample:  # the input's last chunk
            if mode == MEAN:
                vector = state.partial / req.num_prompt_tokens
            else:
                vector = state.partial if mode == CLS else rows[-1].float()
            made.append((i, F.normalize(vector, dim=0) if state.pooling.normalize else vector))
            state.partial = None
    if not made:
        return
    vectors = torch.stack([v for _, v in made]).cpu()  # [made, hidden]; one copy a step
    finite = torch.isfinite(vectors).all(dim=-1).tolist()
    for (i, _), row, ok in zip(made, vectors.numpy().astype("<f4"), finite, strict=True):
        reqs[i].embedding.vector = row.tobytes() if ok else None
        if not ok:
            sampled[i] = SampleFailure(NOT_FINITE)
