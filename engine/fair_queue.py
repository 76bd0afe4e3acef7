"""The waiting queue: strict order between priority classes, round-robin between tenants.

Within a priority class every tenant with waiting requests has its own FIFO, and
the scheduler takes from the tenants in turn, so a tenant that floods the queue
waits behind its own requests, not in front of everyone else's.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from engine.sequence import Sequence


class FairQueue:
    def __init__(self) -> None:
        # priority -> tenant -> that tenant's waiting sequences; the first tenant is next.
        self._classes: dict[int, OrderedDict[str, deque[Sequence]]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def num_tenants(self) -> int:
        """Tenants with a sequence waiting (one counted once per priority class)."""
        return sum(len(tenants) for tenants in self._classes.values())

    def __iter__(self) -> Iterator[Sequence]:
        for priority in sorted(self._classes):
            for queue in self._classes[priority].values():
                yield from queue

    def push(self, seq: Sequence) -> None:
        """A new arrival: at the back of its tenant's queue."""
        tenants = self._classes.setdefault(seq.priority, OrderedDict())
        tenants.setdefault(seq.tenant_id, deque()).append(seq)
        self._len += 1

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: first of its tenant's, and its tenant goes next."""
        tenants = self._classes.setdefault(seq.priority, OrderedDict())
        tenants.setdefault(seq.tenant_id, deque()).appendleft(seq)
        tenants.move_to_end(seq.tenant_id, last=False)
        self._len += 1

    def pop(self) -> Sequence:
        """Takes the next sequence and sends its tenant to the back of the rotation."""
        priority = min(self._classes)
        tenants = self._classes[priority]
        tenant, queue = next(iter(tenants.items()))
        seq = queue.popleft()
        if queue:
            tenants.move_to_end(tenant)
        else:
            del tenants[tenant]
            if not tenants:
                del self._classes[priority]
        self._len -= 1
        return seq

    def best_priority(self) -> int | None:
        """The best (lowest) priority class with a sequence waiting; None when empty."""
        return min(self._classes, default=None)

    def peek(self) -> Sequence:
        """What ``pop`` would hand out next, left waiting."""
        return next(iter(self._classes[min(self._classes)].values()))[0]

    def candidates(self) -> list[Sequence]:
        """Every waiting sequence in the order the queue would hand them out.

        Classes in order; within a class, round by round: each tenant's first, in rotation
        order, then each tenant's second, and so on. The scheduler walks this when the
        head cannot run yet (its adapter has no free slot) and ``take``s what it admits.
        """
        out = []
        for priority in sorted(self._classes):
            queues = list(self._classes[priority].values())
            for depth in range(max(len(q) for q in queues)):
                out.extend(q[depth] for q in queues if depth < len(q))
        return out

    def take(self, seq: Sequence) -> None:
        """Removes ``seq`` as if popped: its tenant goes to the back of the rotation."""
        tenants = self._classes[seq.priority]
        if not self.remove(seq):
            raise ValueError(f"{seq.request_id} is not waiting")
        if seq.tenant_id in tenants:
            tenants.move_to_end(seq.tenant_id)

    def remove(self, seq: Sequence) -> bool:
        tenants = self._classes.get(seq.priority)
        queue = tenants.get(seq.tenant_id) if tenants else None
        if queue is None or seq not in queue:
            return False
        queue.remove(seq)
        if not queue:
            del tenants[seq.tenant_id]
            if not tenants:
                del self._classes[seq.priority]
        self._len -= 1
        return True
