"""Which adapter sits in which GPU slot: the scheduler's plain-Python view of LoRA memory.

A fixed number of slots hold adapters' stacked weights. A running sequence keeps its
adapter's slot in use; a slot no sequence uses is idle and may be given to another
adapter: the least recently used idle one of the tenant furthest over its share of the
slots (engine/lora/shares.py); pinned adapters never leave their slot. A tenant whose plan
caps its adapters in slots, and holds that many, takes a slot only in place of one of its
own idle ones: until one idles, its request waits, and nobody else's. A slot may also be
taken ahead of the request that needs it (``stage``: chosen the same way, left idle) so its
copy is made beside a step. Copying the weights is not decided here: AdapterLifecycle
copies into a slot what a step's rows need, and what it staged.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.lora.shares import Owner, at_limit, fair_victim, own_oldest


class AdapterSlots:
    def __init__(self, num_slots: int, pinned: tuple[str, ...] = (),
                 owners: dict[str, Owner] | None = None,
                 limits: dict[str, int] | None = None) -> None:
        if num_slots < 1:
            raise ValueError("at least one LoRA slot is needed")
        if len(pinned) > num_slots:
            raise ValueError(f"{len(pinned)} pinned adapters do not fit {num_slots} slots")
        self.num_slots = num_slots
        self.pinned = frozenset(pinned)
        self.slot_of: dict[str, int] = {}
        self.owners = owners if owners is not None else {}  # adapter -> its tenant, weight
        self.limits = limits if limits is not None else {}  # tenant -> its adapters at most
        self.users: dict[str, int] = {}  # running sequences per adapter in a slot
        self.evictions = 0  # adapters moved out of their slot for another
        # Sequences started whose adapter was in a slot already, and those it was copied for.
        self.hits = self.misses = 0
        self.staged = 0  # adapters placed ahead of their requests, copied beside a step
        # Idle adapters the first waiting requests will use (staged for them, or left from
        # earlier ones): let go of last, and never to stage another (AdapterLifecycle
        # sets them each step).
        self.kept_for_waiting: set[str] = set()
        self._free = list(range(num_slots - 1, -1, -1))
        self._idle: OrderedDict[str, int] = OrderedDict()  # in a slot, unused: LRU first
        for adapter in pinned:
            self._place(adapter)

    def can_ever_hold(self, adapter: str) -> bool:
        """False when pinned adapters fill every slot and ``adapter`` is not one of them."""
        return adapter in self.pinned or len(self.pinned) < self.num_slots

    def can_acquire(self, adapter: str, tenant: str = "") -> bool:
        if adapter in self.slot_of:
            return True
        if self._limited(tenant):
            return own_oldest(self._idle, self.owners, tenant) is not None
        return bool(self._free) or bool(self._idle)

    def waits_for_own(self, adapter: str, tenant: str) -> bool:
        """The adapter needs a slot its tenant may take only in place of one of its own, and
        none of those is idle: it waits for its tenant's requests, not for the table."""
        return adapter not in self.slot_of and self._limited(tenant) \
            and own_oldest(self._idle, self.owners, tenant) is None

    def acquire(self, adapter: str, tenant: str = "") -> int | None:
        """The adapter's slot, taken for one more running sequence of ``tenant``; None if
        every slot is busy, or every one its tenant may hold."""
        if adapter in self.slot_of:
            self.hits += 1
        elif self._take(adapter, tenant):
            self.misses += 1
        else:
            return None
        self._idle.pop(adapter, None)
        self.users[adapter] = self.users.get(adapter, 0) + 1
        return self.slot_of[adapter]

    def stage(self, adapter: str, tenant: str = "") -> int | None:
        """A slot for an adapter a waiting request of ``tenant`` will need, taken as
        ``acquire`` would take it but idle (its copy is made beside a step), never in place
        of an adapter kept for another waiting request; None when it could take none now."""
        if adapter in self.slot_of or not self._take(adapter, tenant, staging=True):
            return None
        self.staged += 1
        self._idle[adapter] = self.slot_of[adapter]
        self.kept_for_waiting.add(adapter)
        return self.slot_of[adapter]

    def _take(self, adapter: str, tenant: str, staging: bool = False) -> bool:
        """Places ``adapter`` in a free slot, or in that of the idle adapter to let go of:
        one no waiting request is about to use where there is such (staging: only such)."""
        idle = [a for a in self._idle if a not in self.kept_for_waiting]
        if not idle and not staging:
            idle = list(self._idle)
        if self._limited(tenant):  # in place of its own oldest idle adapter, or none
            victim = own_oldest(idle, self.owners, tenant) or (
                None if staging else own_oldest(self._idle, self.owners, tenant))
            if victim is None:
                return False
        elif self._free:
            victim = None
        elif idle:
            victim = fair_victim(idle, self.slot_of, self.owners, self.owners.get(adapter))
        else:
            return False
        if victim is not None:
            self._evict(victim)
        self._place(adapter)
        return True

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

    def _limited(self, tenant: str) -> bool:
        """The tenant holds as many slots as its plan allows (pinned adapters not counted)."""
        return at_limit(tenant, (a for a in self.slot_of if a not in self.pinned), self.owners,
                        self.limits)

    def _evict(self, adapter: str) -> None:
        self._free.append(self._idle.pop(adapter))
        del self.slot_of[adapter]
        self.evictions += 1

    def _place(self, adapter: str) -> None:
        slot = self._free.pop()
        self.slot_of[adapter] = slot


class SlotClaims:
    """The waiting queue's claims on the slots in one scheduling pass, in queue order.

    NOTE: once one waits for a slot, no sequence after it takes an adapter slot, not even
    one whose adapter is already in: else a busy adapter's stream of requests keeps every
    slot busy and the one waiting never gets one. Now a slot drains. One waiting for a slot
    of its own tenant's to idle (its plan's limit) holds back that tenant's requests only.
    """

    def __init__(self, slots: AdapterSlots | None) -> None:
        self.slots = slots
        self.table_full = False
        self.tenants_waiting: set[str] = set()

    def admit(self, adapter: str, tenant: str) -> bool:
        """Whether a sequence of ``tenant`` using ``adapter`` may take its slot now."""
        if tenant in self.tenants_waiting or self.slots.waits_for_own(adapter, tenant):
            self.tenants_waiting.add(tenant)
            return False
        if self.table_full or not self.slots.can_acquire(adapter, tenant):
            self.table_full = True
            return False
        return True
