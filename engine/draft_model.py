"""The draft-model proposer (``ATRIUM_SPECULATIVE=draft:PATH``; engine/speculative.py).

A smaller checkpoint with the target's tokenizer proposes each speculating sequence's
draft: its greedy continuation, ``k`` tokens in ``k`` forward passes batched over the
sequences. It keeps a paged KV cache of its own (its own blocks, no prefix cache), in
which each sequence holds the tokens the draft model has read. Before a proposal a
sequence's new tokens are read in one pass (the prompt at first, later the tokens the
target kept); draft tokens the target rejects are dropped from that cache again
(``keep_accepted``), and a sequence that ends gives its blocks back.

The drafts are greedy, so the proposer puts all its probability on each draft token, and
verification (greedy, or rejection sampling for temperature > 0) is the same as for n-gram
drafts: the output never changes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engine.batch import ScheduledRequest, SchedulerOutput
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.models.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(slots=True)
class _View:
    """What the KV cache manager reads of a sequence: its id and how much of it the draft
    model has read."""

    request_id: str
    num_computed_tokens: int = 0
    num_read: int = 0  # tokens of the sequence proposed from (what the next step verifies)
    num_fed: int = 0  # draft tokens read into the cache past them


class DraftModel:
    def __init__(self, config: EngineConfig, draft_dir: Path, *, target: ModelConfig,
                 target_dir: Path, target_blocks: int, max_model_len: int) -> None:
        draft = ModelConfig.from_dir(draft_dir)
        if draft.vocab_size != target.vocab_size or (draft_dir / "tokenizer.json").read_bytes() \
                != (target_dir / "tokenizer.json").read_bytes():
            raise ValueError(f"the draft model at {draft_dir} does not share the target's "
                             "tokenizer and vocabulary")
        # NOTE: its own KV pool of a quarter of the target's blocks (each smaller: a smaller
        # model), counted, not sized from free memory: on a GPU the target took that.
        own = dataclasses.replace(config, model_dir=draft_dir, speculative="off",
                                  num_kv_blocks=max(1, target_blocks // 4),
                                  adapter_store=None, pinned_adapters=())
        self.runner = ModelRunner(own, draft, max_model_len, enable_lora=False)
        self.kv = KVCacheManager(num_blocks=self.runner.num_blocks, block_size=own.block_size,
                                 enable_prefix_caching=False)
        self.views: dict[str, _View] = {}

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Up to ``k`` greedy draft tokens for each (sequence, k); a sequence the draft
        cache has no room for gets none. A failing draft model costs only the drafts."""
        try:
            return self._propose(wanted)
        except Exception:  # noqa: BLE001 - speculation must never fail a request
            log.exception("the draft model failed; these sequences do not speculate now")
            for seq, _ in wanted:  # what its cache holds for them is in doubt
                if (view := self.views.pop(seq.request_id, None)) is not None:
                    self.kv.free(view)
            return {}

    def _propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        rows: list[tuple[Sequence, _View, int]] = []
        for seq, k in wanted:
            view = self.views.setdefault(seq.request_id, _View(seq.request_id))
            view.num_computed_tokens = min(view.num_computed_tokens, seq.num_tokens - 1)
            new = seq.num_tokens - view.num_computed_tokens
            if k > 0 and self.kv.allocate_slots(view, new + k - 1):
                rows.append((seq, view, k))
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq, _, _ in rows}
        batch = [ScheduledRequest(
            request_id=seq.request_id, token_ids=seq.token_ids[view.num_computed_tokens:],
            start_pos=view.num_computed_tokens, block_table=self.kv.block_table(view),
            sample=True, sampling=_GREEDY) for seq, view, _ in rows]
        for seq, view, _ in rows:
            view.num_read = view.num_computed_tokens = seq.num_tokens
            view.num_fed = 0
        for step in range(max((k for _, _, k in rows), default=0)):
            ran = self.runner.run(SchedulerOutput(batch))
            going = []
            for (seq, view, k), token in zip(rows, ran.sampled, strict=True):
                if not isinstance(token, int):
                    continue  # the draft model failed this row: the draft ends here
                drafts[seq.request_id].append(token)
                if step + 1 < k:
                    going.append((seq, view, k))
            rows, batch = going, [ScheduledRequest(
                request_id=seq.request_id, token_ids=[drafts[seq.request_id][-1]],
                start_pos=view.num_computed_tokens, block_table=self.kv.block_table(view),
                sample=True, sampling=_GREEDY) for seq, view, _ in going]
            for _, view, _ in going:
                view.num_computed_tokens += 1
                view.num_fed += 1
        return drafts

    def keep_accepted(self, proposed: Iterable[str], accepted: dict[str, int]) -> None:
        """After the target's step: each proposed sequence's cache keeps the draft tokens
        the target accepted (none for one that did not speculate), drops the rest."""
        for request_id in proposed:
            view = self.views.get(request_id)
            if view is None:
                continue
            view.num_computed_tokens = view.num_read + min(accepted.get(request_id, 0),
                                                           view.num_fed)
            self.kv.trim(view, view.num_computed_tokens + 1)

    def forget(self, alive: Iterable[str]) -> None:
        """Gives back the blocks of sequences that ended (not in ``alive``)."""
        alive = set(alive)
        for request_id in [r for r in self.views if r not in alive]:
            self.kv.free(self.views.pop(request_id))
