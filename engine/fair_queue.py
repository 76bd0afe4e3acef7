"""The waiting queue: strict order between classes, token-fair between tenants.

A sequence's class is its ``rank``: its service tier, then its plan's priority. Within a
class every tenant with waiting sequences has its own FIFO, and the queue hands out the
head of the tenant that has received the least service (engine/fair_share.py; ties in
turn), so a tenant that floods the queue, or sends long prompts, waits behind its own
requests, not in front of everyone else's.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from engine import protocol
from engine.fair_share import ServiceCounters
from engine.sequence import Sequence

Rank = tuple[int, int]


class FairQueue:
    def __init__(self, counters: ServiceCounters | None = None) -> None:
        self.counters = counters or ServiceCounters()
        # rank -> tenant -> that tenant's waiting sequences; among equals, the first goes next.
        self._classes: dict[Rank, OrderedDict[str, deque[Sequence]]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def num_tenants(self) -> int:
        """Tenants with a sequence waiting (one counted once per class)."""
        return sum(len(tenants) for tenants in self._classes.values())

    def num_in(self, tiers: frozenset[str]) -> int:
        """Sequences waiting in ``tiers``."""
        ranks = {protocol.TIERS.index(t) for t in tiers}
        return sum(len(q) for rank, tenants in self._classes.items() if rank[0] in ranks
                   for q in tenants.values())

    def __iter__(self) -> Iterator[Sequence]:
        for rank in sorted(self._classes):
            for queue in self._classes[rank].values():
                yield from queue

    def push(self, seq: Sequence) -> None:
        """A new arrival: at the back of its tenant's queue."""
        self.counters.queued(seq.tenant_id)
        tenants = self._classes.setdefault(seq.rank, OrderedDict())
        tenants.setdefault(seq.tenant_id, deque()).append(seq)
        self._len += 1

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: first of its tenant's, and first among tenants served alike."""
        self.counters.queued(seq.tenant_id)
        tenants = self._classes.setdefault(seq.rank, OrderedDict())
        tenants.setdefault(seq.tenant_id, deque()).appendleft(seq)
        tenants.move_to_end(seq.tenant_id, last=False)
        self._len += 1

    def pop(self) -> Sequence:
        """Takes the next sequence (``peek``'s)."""
        seq = self.peek()
        self.take(seq)
        return seq

    def best_rank(self) -> Rank | None:
        """The best (lowest) class with a sequence waiting; None when empty."""
        return min(self._classes, default=None)

    def peek(self) -> Sequence:
        """What ``pop`` would hand out next, left waiting: the best class's least-served
        tenant's first."""
        return self._classes[min(self._classes)][self._least_served(min(self._classes))][0]

    def candidates(self) -> Iterator[Sequence]:
        """Every waiting sequence in the order the queue would hand them out, chosen one at a
        time: class by class, and within a class the least-served tenant's first not yet
        offered. The scheduler ``take``s and charges what it admits as it walks, so a
        tenant that was just admitted a long prompt falls behind the others in the same walk.
        """
        for rank in sorted(self._classes):
            offered: set[int] = set()
            turns: dict[str, int] = {}  # sequences offered per tenant: equals take turns
            while (seq := self._next_unoffered(rank, offered, turns)) is not None:
                offered.add(id(seq))
                turns[seq.tenant_id] = turns.get(seq.tenant_id, 0) + 1
                yield seq

    def take(self, seq: Sequence) -> None:
        """Removes ``seq`` as if popped: its tenant goes behind those served alike."""
        tenants = self._classes[seq.rank]
        if not self.remove(seq):
            raise ValueError(f"{seq.request_id} is not waiting")
        if seq.tenant_id in tenants:
            tenants.move_to_end(seq.tenant_id)

    def remove(self, seq: Sequence) -> bool:
        tenants = self._classes.get(seq.rank)
        queue = tenants.get(seq.tenant_id) if tenants else None
        if queue is None or seq not in queue:
            return False
        queue.remove(seq)
        self.counters.dequeued(seq.tenant_id)
        if not queue:
            del tenants[seq.tenant_id]
            if not tenants:
                del self._classes[seq.rank]
        self._len -= 1
        return True

    def _least_served(self, rank: Rank) -> str:
        # NOTE: min keeps the first of equals: the rotation order breaks ties.
        return min(self._classes[rank], key=self.counters.__getitem__)

    def _next_unoffered(self, rank: Rank, offered: set[int],
                        turns: dict[str, int]) -> Sequence | None:
        best, best_key = None, (0.0, 0)
        for tenant, queue in self._classes.get(rank, {}).items():
            head = next((s for s in queue if id(s) not in offered), None)
            key = (self.counters[tenant], turns.get(tenant, 0))
            if head is not None and (best is None or key < best_key):
                best, best_key = head, key
        return best
