"""Grammar compiles waiting for a thread, one queue per tenant, taken in turn.

A schema can take the compiler seconds. With one queue for everyone, a tenant sending a
stream of slow schemas would put every other tenant's structured request behind all of
them; here each free thread takes the next compile of the tenant whose turn it is, so a
tenant waits behind its own compiles and at most one of each other tenant's. And no
tenant runs more than ``share`` compiles at once (by default all threads but one): with
two threads or more, one is always left for the others.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

Job = tuple[Future, Callable[[Any], Any], Any]
COMPILE_NICE = 10


class CompileTurns:
    """An executor of ``threads`` threads that serves tenants round-robin."""

    def __init__(self, threads: int, *, share: int | None = None,
                 name: str = "grammar") -> None:
        self.share = share or max(1, threads - 1)
        self._waiting: OrderedDict[str, deque[Job]] = OrderedDict()
        self._running: dict[str, int] = {}
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, tenant: str, fn: Callable[[Any], Any], arg: Any) -> Future:
        """``fn(arg)``'s future, run in ``tenant``'s turn."""
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the compile threads are stopped")
            self._waiting.setdefault(tenant, deque()).append((future, fn, arg))
            self._ready.notify()
        return future

    def waiting(self, tenant: str) -> int:
        with self._ready:
            return len(self._waiting.get(tenant, ()))

    def close(self) -> None:
        """Cancels what waits; compiles already running finish first."""
        with self._ready:
            self._closed = True
            for jobs in self._waiting.values():
                for future, _, _ in jobs:
                    future.cancel()
            self._waiting.clear()
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()

    def _next(self) -> tuple[str, Job] | None:
        """The oldest job of the first tenant in line with room in its share; that tenant
        then goes to the back. NOTE: called with the condition held."""
        tenant = next((t for t in self._waiting if self._running.get(t, 0) < self.share),
                      None)
        if tenant is None:
            return None
        jobs = self._waiting.pop(tenant)
        job = jobs.popleft()
        if jobs:
            self._waiting[tenant] = jobs
        self._running[tenant] = self._running.get(tenant, 0) + 1
        return tenant, job

    def _work(self) -> None:
        # NOTE: a compile thread yields the CPU to the engine's step loop: on Linux a
        # thread's niceness is its own (elsewhere this changes nothing).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
        while True:
            with self._ready:
                while (taken := self._next()) is None and not self._closed:
                    self._ready.wait()
                if taken is None:
                    return
            tenant, (future, fn, arg) = taken
            try:
                if future.set_running_or_notify_cancel():
                    future.set_result(fn(arg))
            except BaseException as error:  # noqa: BLE001 - the caller's future carries it
                future.set_exception(error)
            finally:
                with self._ready:
                    self._running[tenant] -= 1
                    if not self._running[tenant]:
                        del self._running[tenant]
                    self._ready.notify()  # the tenant's next job may go now
