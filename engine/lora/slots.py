"""Which adapter sits in which GPU slot: the scheduler's plain-Python view of LoRA memory.

A fixed number of slots hold adapters' stacked weights. A running sequence keeps its
adapter's slot in use; a slot no sequence uses is idle and may be given to another
adapter: the least recently used idle one of the tenant furthest over its share of the
slots (engine/lora/shares.py); pinned adapters never leave their slot. Copying the
weights is not decided here: AdapterLifecycle copies into a slot what a step's rows need.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.lora.shares import Owner, fair_victim


class AdapterSlots:
    def __init__(self, num_slots: int, pinned: tuple[str, ...] = (),
                 owners: dict[str, Owner] | None = None) -> None:
        if num_slots < 1:
            raise ValueError("at least one LoRA slot is needed")
        if len(pinned) > num_slots:
            raise ValueError(f"{len(pinned)} pinned adapters do not fit {num_slots} slots")
        self.num_slots = num_slots
        self.pinned = frozenset(pinned)
        self.slot_of: dict[str, int] = {}
        self.owners = owners if owners is not None else {}  # adapter -> its tenant, weight
        self.users: dict[str, int] = {}  # running sequences per adapter in a slot
        self.evictions = 0  # adapters moved out of their slot for another
        # Sequences started whose adapter was in a slot already, and those it was copied for.
        self.hits = self.misses = 0
        self._free = list(range(num_slots - 1, -1, -1))
        self._idle: OrderedDict[str, int] = OrderedDict()  # in a slot, unused: LRU first
        for adapter in pinned:
            self._place(adapter)

    def can_ever_hold(self, adapter: str) -> bool:
        """False when pinned adapters fill every slot and ``adapter`` is not one of them."""
        return adapter in self.pinned or len(self.pinned) < self.num_slots

    def can_acquire(self, adapter: str) -> bool:
        return adapter in self.slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, adapter: str) -> int | None:
        """The adapter's slot, taken for one more running sequence; None if every slot is busy."""
        if adapter in self.slot_of:
            self.hits += 1
        else:
            if not self._free and not self._idle:
                return None
            self.misses += 1
            if not self._free:
                evicted = fair_victim(self._idle, self.slot_of, self.owners,
                                      self.owners.get(adapter))
                slot = self._idle.pop(evicted)
                del self.slot_of[evicted]
                self._free.append(slot)
                self.evictions += 1
            self._place(adapter)
        self._idle.pop(adapter, None)
        self.users[adapter] = self.users.get(adapter, 0) + 1
        return self.slot_of[adapter]

    def release(self, adapter: str) -> None:
        self.users[adapter] -= 1
        if self.users[adapter] == 0:
            del self.users[adapter]
            if adapter not in self.pinned:
                self._idle[adapter] = self.slot_of[adapter]

    def forget(self, adapter: str) -> None:
        """Frees a deleted adapter's slot if no sequence uses it (else it frees on release)."""
        if adapter in self._idle and adapter not in self.pinned:
            self._free.append(self._idle.pop(adapter))
            del self.slot_of[adapter]

    def _place(self, adapter: str) -> None:
        slot = self._free.pop()
        self.slot_of[adapter] = slot
