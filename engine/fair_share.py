"""Token-fair service between tenants: a Virtual Token Counter (S-LoRA's fairness scheme).

Each tenant has a counter of the service it has received on this engine, in weighted
tokens divided by its plan's weight: a prompt token computed counts PROMPT_COST, a token
generated OUTPUT_COST (a decode step costs more than a prompt token run in a batch), and
a token computed again after a preemption, or found in the prefix cache, costs nothing.
The waiting queue serves, within a class, the tenant with the least counter
(engine/fair_queue.py), and preemption takes from the one with the most, so tenants that
send 8k-token prompts and tenants that send 200-token ones at the same rate get equal
tokens of service, not equal requests.

Lifting: a tenant that becomes active (has a sequence here again) starts no lower than
the least counter among the active tenants, or, when none is active, than the level the
last one left at. Time spent idle banks no credit to spend later against the others.
"""

from __future__ import annotations

from engine.sequence import Sequence

PROMPT_COST = 1.0
OUTPUT_COST = 2.0


class ServiceCounters:
    def __init__(self) -> None:
        self._counter: dict[str, float] = {}
        self._active: dict[str, int] = {}  # tenant -> its sequences here (waiting or running)
        self._idle_level = 0.0  # where the last active tenant left off

    def __getitem__(self, tenant: str) -> float:
        return self._counter.get(tenant, self._idle_level)

    def arrive(self, tenant: str) -> None:
        """One more sequence of ``tenant`` is here; lifts its counter if it was idle."""
        if tenant not in self._active:
            floor = min((self._counter[t] for t in self._active), default=self._idle_level)
            self._counter[tenant] = max(self._counter.get(tenant, floor), floor)
            self._active[tenant] = 0
        self._active[tenant] += 1

    def leave(self, tenant: str) -> None:
        """One of ``tenant``'s sequences is gone."""
        self._active[tenant] -= 1
        if self._active[tenant]:
            return
        del self._active[tenant]
        if not self._active:
            # NOTE: every counter at or below the level would be lifted to it on arrival:
            # forgetting them keeps the table to the tenants that are ahead.
            self._idle_level = self._counter[tenant]
            self._counter = {t: c for t, c in self._counter.items() if c > self._idle_level}

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
        if prompt or output:
            self._counter[seq.tenant_id] = self[seq.tenant_id] + \
                (PROMPT_COST * prompt + OUTPUT_COST * output) / seq.fair_weight
        return max(0, end - max(start, done))

    def active(self) -> list[str]:
        return list(self._active)
