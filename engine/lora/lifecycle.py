"""An adapter's life in one engine, in one place: load, pin, hold, wait, release, evict.

Host memory (`AdapterCache`: background loads from the store, an LRU of unused ones)
and device slots (`AdapterSlots`: which adapter sits in which slot, pinned ones never
leave) are this component's parts. The engine asks it whether a request's adapter can
ever be served, hands it sequences whose adapter is still loading, and tells it when a
request finished; the scheduler only asks the slots whether a sequence may start. Before
each step the engine has it copy into the device slots what the batch's rows need
(``fill_slots``: the one place that decides a copy; the runner makes it, and refuses to
run a row whose slot holds anything else).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch

from engine import protocol
from engine.batch import ScheduledRequest
from engine.lora.cache import AdapterCache
from engine.lora.slots import AdapterSlots
from engine.lora.store import AdapterStore, is_hash
from engine.models.model_config import ModelConfig
from engine.outputs import RequestOutput
from engine.parallel import choices_of, usage_of
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.fair_queue import FairQueue
    from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

# Each step looks this far into the waiting queue for adapters to copy into slots beside
# it, and starts at most this many copies (a step is ~20 ms, a demo rank-16 copy ~1 ms).
_STAGE_LOOKAHEAD = 8
_STAGE_PER_STEP = 2


class AdapterLifecycle:
    def __init__(self, store: AdapterStore, model_config: ModelConfig, *, max_rank: int,
                 dtype: torch.dtype, host_capacity: int, num_slots: int,
                 pinned: tuple[str, ...] = ()) -> None:
        # Adapter -> the tenant whose request used it last, and its weight: whose share of
        # host memory and of the slots it counts against (engine/lora/shares.py).
        self.owners: dict[str, tuple[str, float]] = {}
        # Tenant -> how many adapters its plan lets it hold in each tier (its latest request's
        # max_resident_adapters); a tenant with none is absent.
        self.limits: dict[str, int] = {}
        self.cache = AdapterCache(store, model_config, max_rank=max_rank, dtype=dtype,
                                  capacity=host_capacity, owners=self.owners,
                                  limits=self.limits)
        for adapter_hash in pinned:
            self.cache.load_now(adapter_hash)
            self.cache.retain(adapter_hash)
        self.slots = AdapterSlots(num_slots, pinned=pinned, owners=self.owners,
                                  limits=self.limits)
        if len(self.slots.pinned) == self.slots.num_slots:
            log.warning("pinned adapters fill all %d LoRA slots: requests for any other "
                        "adapter are refused", self.slots.num_slots)
        self._loading: dict[str, list[Sequence]] = {}  # adapter hash -> sequences waiting
        self._adapter_of: dict[str, str] = {}  # request id -> adapter hash, until it ends
        self.names: dict[str, str] = {}  # adapter hash -> the name requests call it by
        # Requests whose adapter was in host memory when they arrived, and those it was not.
        self.host_hits = self.host_misses = 0
        self.stage_per_step = _STAGE_PER_STEP  # copies started beside a step at most

    # -- what the engine asks ---------------------------------------------------------------

    def __contains__(self, adapter_hash: str) -> bool:
        """The adapter is loaded here (in host memory)."""
        return adapter_hash in self.cache

    def check(self, adapter_hash: str, name: str | None) -> None:
        """Refuses (ValueError) an adapter this engine could never apply."""
        if not is_hash(adapter_hash):
            raise ValueError("adapter_hash must be a 64-character lowercase hex hash")
        if not self.slots.can_ever_hold(adapter_hash):
            # NOTE: refused, not queued: it would wait for a slot that never frees.
            raise ValueError(f"adapter {name or adapter_hash} is not served by this engine: "
                             f"pinned adapters fill all its LoRA slots")
        if not self.cache.store.exists(adapter_hash) and not self.cache.store.can_fetch:
            raise ValueError(f"adapter {name or adapter_hash} is not in the adapter store")
        if name:
            self.names[adapter_hash] = name  # for the metrics (vllm:lora_requests_info)

    def hold(self, seq: Sequence) -> bool:
        """Holds the sequence's adapter until it finishes; True when the adapter is in host
        memory already (the sequence may queue now), else it waits here for the load."""
        adapter_hash = seq.adapter_hash
        self.owners[adapter_hash] = (seq.tenant_id, seq.fair_weight)
        if seq.max_resident_adapters:
            self.limits[seq.tenant_id] = seq.max_resident_adapters
        else:
            self.limits.pop(seq.tenant_id, None)
        self.cache.retain(adapter_hash)
        self._adapter_of[seq.request_id] = adapter_hash
        if adapter_hash in self:
            self.host_hits += 1
            return True
        self.host_misses += 1
        self._loading.setdefault(adapter_hash, []).append(seq)
        return False

    def info(self, waiting: Iterable[Sequence]) -> dict[str, Any]:
        """Adapters running (in a slot, used by a running sequence) and waiting (loading,
        or queued behind ``waiting``), by name, and the slots there are."""
        queued = {s.adapter_hash for s in waiting if s.adapter_hash} | set(self._loading)
        return {"max_lora": self.slots.num_slots,
                "running": sorted(self.names.get(a, a) for a in self.slots.users),
                "waiting": sorted(self.names.get(a, a) for a in queued)}

    def stats(self) -> dict[str, Any]:
        """The tiers' figures for the engine's metrics snapshot."""
        slots = self.slots
        return {"adapter_slot_evictions": slots.evictions, "adapter_slot_hits": slots.hits,
                "adapter_slot_misses": slots.misses, "adapter_slot_staged": slots.staged,
                "adapter_host_hits": self.host_hits,
                "adapter_host_misses": self.host_misses,
                "adapter_load": self.cache.load_seconds.to_dict()}

    def resident(self) -> list[str]:
        """The adapters in host memory (a slot is a copy away) or on their way there, as
        content hashes, sorted: the requests placed here next for one of them wait for no
        other load."""
        return sorted({*self.cache.loaded(), *self._loading})

    def holds_request(self, request_id: str) -> bool:
        return any(s.request_id == request_id for w in self._loading.values() for s in w)

    @property
    def num_loading(self) -> int:
        """Sequences waiting for their adapter's load."""
        return sum(len(s) for s in self._loading.values())

    def abort(self, request_id: str, reason: str) -> RequestOutput | None:
        """Ends a sequence still waiting for its adapter; None when none such waits."""
        for seqs in self._loading.values():
            for seq in seqs:
                if seq.request_id == request_id:
                    seqs.remove(seq)
                    return RequestOutput(request_id, finished=True, finish_reason=reason,
                                         usage=usage_of(seq),
                                         choices=choices_of(seq, reason))
        return None

    def loaded(self, *, idle: bool) -> tuple[list[Sequence], list[RequestOutput]]:
        """Sequences whose adapter finished loading (to queue), and the ends of those whose
        load failed or whose deadline passed while waiting. ``idle``: nothing else to run,
        so wait briefly for a load rather than spin."""
        if not self._loading:
            return [], []
        if idle:
            self.cache.wait(timeout=0.05)
        ready, failed = self.cache.poll()
        ready_seqs = [seq for adapter_hash in ready for seq in self._loading.pop(adapter_hash, [])]
        loaded_at = time.monotonic()
        for seq in ready_seqs:
            seq.adapter_ready_at = loaded_at
        outputs = []
        now = time.time()
        for seqs in self._loading.values():
            for seq in [s for s in seqs if s.deadline is not None and now >= s.deadline]:
                seqs.remove(seq)
                outputs.append(RequestOutput(seq.request_id, finished=True, usage=usage_of(seq),
                                             finish_reason=protocol.FINISH_DEADLINE,
                                             choices=choices_of(seq, protocol.FINISH_DEADLINE)))
        for adapter_hash, reason in failed:
            for seq in self._loading.pop(adapter_hash, []):
                outputs.append(RequestOutput(
                    seq.request_id, finished=True, usage=usage_of(seq), error=reason,
                    error_code=protocol.ERROR_INVALID_REQUEST))
        return ready_seqs, outputs

    def release_finished(self, outputs: list[RequestOutput | None]) -> None:
        """Lets go of the adapters of sequences that just finished."""
        for out in outputs:
            if out is not None and out.finished:
                adapter_hash = self._adapter_of.pop(out.request_id, None)
                if adapter_hash is not None:
                    self.cache.release(adapter_hash)
        if len(self.owners) > 2 * (self.cache.capacity + self.slots.num_slots):
            # Forget the owners of adapters neither tier holds any more.
            kept = {*self.cache.loaded(), *self.slots.slot_of, *self._adapter_of.values()}
            for adapter_hash in [a for a in self.owners if a not in kept]:
                del self.owners[adapter_hash]
            tenants = {tenant for tenant, _ in self.owners.values()}
            for tenant in [t for t in self.limits if t not in tenants]:
                del self.limits[tenant]

    # -- device slots -----------------------------------------------------------------------

    def start(self, runner: ModelRunner) -> None:
        """Copies the pinned adapters into their slots, before any request."""
        self._copy_in(runner, [(slot, h) for h, slot in self.slots.slot_of.items()])

    def fill_slots(self, runner: ModelRunner, requests: list[ScheduledRequest],
                   waiting: FairQueue | None = None) -> None:
        """Copies into each slot the batch's rows use the adapter it must hold, after the
        copies staged beside the last step; then stages, beside this step, the adapters of
        the requests next in ``waiting`` (in host memory, in no slot), so that they find
        them in place: a copy into a slot holds up no step but the one it was needed for
        before it finished."""
        runner.settle_adapter_copies()
        self._copy_in(runner, [(r.adapter_slot, r.adapter_hash) for r in requests
                               if r.adapter_slot >= 0])
        if waiting is None or not requests:  # nothing to copy beside
            return
        ahead = [s for s in islice(waiting.candidates(), _STAGE_LOOKAHEAD)
                 if s.adapter_hash is not None]
        slots = self.slots
        slots.kept_for_waiting = {s.adapter_hash for s in ahead if s.adapter_hash in slots.slot_of}
        staged = 0
        for seq in ahead:
            if staged == self.stage_per_step:
                return
            adapter_hash = seq.adapter_hash
            if adapter_hash not in self.cache or adapter_hash in slots.slot_of:
                continue
            slot = slots.stage(adapter_hash, seq.tenant_id)
            if slot is not None:  # else none it may take now: the scheduler waits for one
                runner.copy_adapter_beside(slot, self.cache.get(adapter_hash))
                staged += 1

    def _copy_in(self, runner: ModelRunner, wanted: list[tuple[int, str | None]]) -> None:
        # NOTE: the runner's record of what a slot holds (set only once a copy completes)
        # is the truth, not the slot table: a copy lost or failed earlier is made again.
        for slot, adapter_hash in wanted:
            if runner.adapter_in_slot(slot) != adapter_hash:
                if adapter_hash is None:
                    raise ValueError(f"a row uses LoRA slot {slot} without naming its adapter")
                runner.copy_adapter(slot, self.cache.get(adapter_hash))

    # -- deletions ----------------------------------------------------------------------------

    def forget(self, adapter_hash: str) -> None:
        """The platform deleted this adapter: let go of it wherever nothing still uses it."""
        self.cache.forget(adapter_hash)
        self.slots.forget(adapter_hash)
