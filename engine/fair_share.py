"""Token-fair service between tenants: a Virtual Token Counter (S-LoRA's fairness scheme).

Each tenant has a counter of the service it has received on this engine, in weighted
tokens divided by its plan's weight: a prompt token computed counts PROMPT_COST, a token
generated OUTPUT_COST (a decode step costs more than a prompt token run in a batch), and
a token computed again after a preemption, or found in the prefix cache, costs nothing.
The waiting queue serves, within a class, the tenant with the least counter
(engine/fair_queue.py), and preemption takes from the one with the most, so tenants that
send 8k-token prompts and tenants that send 200-token ones at the same rate get equal
tokens of service, not equal requests.

Lifting: a tenant that joins the waiting queue with nothing there yet starts no lower than
the least counter among the tenants waiting, or, when none is, than the level the last one
to leave the queue had then. Time spent idle banks no credit to spend later against the
others; service a tenant got while nobody else waited is not held against it.
"""

from __future__ import annotations

from engine.sequence import Sequence

PROMPT_COST = 1.0
OUTPUT_COST = 2.0
# What a counter counts: tokens (the default), or requests: a request admitted counts 1
# whatever its length, tenants taking turns by request (the engine's round-robin before
# token-fair scheduling; bench/tiers.py's peer).
FAIR_SHARES = ("tokens", "requests")


class ServiceCounters:
    def __init__(self, share: str = "tokens") -> None:
        if share not in FAIR_SHARES:
            raise ValueError(f"fair share must be one of {', '.join(FAIR_SHARES)}")
        self.by_requests = share == "requests"
        self._counter: dict[str, float] = {}
        self._active: dict[str, int] = {}  # tenant -> its sequences here (waiting or running)
        self._waiting: dict[str, int] = {}  # tenant -> its sequences in the waiting queue
        self._idle_level = 0.0  # the counter of the last tenant to leave the queue empty

    def __getitem__(self, tenant: str) -> float:
        return self._counter.get(tenant, self._idle_level)

    def arrive(self, tenant: str) -> None:
        """One more sequence of ``tenant`` is here (waiting or running)."""
        self._active[tenant] = self._active.get(tenant, 0) + 1

    def leave(self, tenant: str) -> None:
        """One of ``tenant``'s sequences is gone; a tenant with none left is forgotten when
        its counter is one it would be lifted to anyway."""
        self._active[tenant] -= 1
        if self._active[tenant]:
            return
        del self._active[tenant]
        if tenant in self._counter and self._counter[tenant] <= self._floor():
            del self._counter[tenant]

    def queued(self, tenant: str) -> None:
        """A sequence of ``tenant`` joins the waiting queue; lifts its counter if it had none
        there."""
        if tenant not in self._waiting:
            floor = self._floor()
            self._counter[tenant] = max(self._counter.get(tenant, floor), floor)
            self._waiting[tenant] = 0
        self._waiting[tenant] += 1

    def dequeued(self, tenant: str) -> None:
        """A sequence of ``tenant`` left the waiting queue (started, or ended there)."""
        self._waiting[tenant] -= 1
        if self._waiting[tenant]:
            return
        del self._waiting[tenant]
        if not self._waiting:
            self._idle_level = self[tenant]

    def standing(self, most: int) -> dict[str, int]:
        """The tenants here most ahead of the least-served waiting one (``most`` of them),
        each with how far, in weighted tokens: what routing places by (the heartbeat's)."""
        floor = self._floor()
        ahead = sorted(((self._counter.get(t, floor) - floor, t) for t in self._active),
                       reverse=True)
        return {t: round(excess) for excess, t in ahead[:most] if excess >= 1}

    def _floor(self) -> float:
        """Where a tenant joining the queue starts at the least."""
        return min((self._counter[t] for t in self._waiting), default=self._idle_level)

    def active(self) -> list[str]:
        return list(self._active)

    def charge(self, seq: Sequence, start: int, n: int) -> int:
        """``seq`` runs positions [start, start + n) this step; charges its tenant, and
        returns how many of those positions run for the first time.

        NOTE: the prompt is charged whole when it is admitted (what it commits the engine to,
        as S-LoRA does), output tokens as they are made: charging prompt chunks as they ran
        would let a tenant with long prompts have several admitted before its counter moved.
        """
        end = start + n
        done = seq.num_charged_tokens
        prompt = max(0, seq.num_prompt_tokens - start) if done == 0 else 0
        output = max(0, end - max(done, seq.num_prompt_tokens, start))
        seq.num_charged_tokens = max(done, end)
        if self.by_requests:
            prompt, output = (1 if done == 0 and seq.index == 0 else 0), 0
        if prompt or output:
            self._counter[seq.tenant_id] = self[seq.tenant_id] + \
                (PROMPT_COST * prompt + OUTPUT_COST * output) / seq.fair_weight
        return max(0, end - max(start, done))
