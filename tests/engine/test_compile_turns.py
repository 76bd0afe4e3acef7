"""Grammar compiles taken in turn by tenant (engine/compile_turns.py): a tenant's backlog of
slow schemas keeps its own structured requests waiting, not another tenant's."""

from __future__ import annotations

import threading
import time

import pytest

from engine.compile_turns import CompileTurns


@pytest.fixture
def turns():
    pool = CompileTurns(1)
    yield pool
    pool.close()


def test_a_tenants_backlog_waits_behind_itself_not_in_front_of_another(turns):
    started, release, order = threading.Event(), threading.Event(), []

    def hold(_):
        started.set()
        release.wait()

    turns.submit("hostile", hold, None)  # holds the only thread
    assert started.wait(5)
    theirs = [turns.submit("hostile", order.append, f"hostile-{i}") for i in range(5)]
    ours = turns.submit("quiet", order.append, "quiet-0")
    assert turns.waiting("hostile") == 5 and not ours.done()
    release.set()
    ours.result(timeout=10)
    for future in theirs:
        future.result(timeout=10)
    # hostile's first was in line first; quiet's comes next, before the rest of hostile's.
    assert order == ["hostile-0", "quiet-0", "hostile-1", "hostile-2", "hostile-3",
                     "hostile-4"]


def test_with_two_threads_one_tenant_never_holds_both():
    pool, release = CompileTurns(2), threading.Event()
    try:
        held = [pool.submit("hostile", lambda _: release.wait(10), None) for _ in range(4)]
        deadline = time.monotonic() + 5
        while not held[0].running():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        quiet = pool.submit("quiet", lambda x: x, "compiled")
        assert quiet.result(timeout=5) == "compiled"  # the thread hostile may not take
        assert sum(f.running() for f in held) == 1 and pool.waiting("hostile") == 3
        release.set()
        assert all(f.result(timeout=10) for f in held)
    finally:
        release.set()
        pool.close()


def test_a_failing_compile_fails_its_own_future_and_the_thread_goes_on(turns):
    def boom(_):
        raise ValueError("no grammar")

    failed = turns.submit("a", boom, None)
    with pytest.raises(ValueError):
        failed.result(timeout=10)
    assert turns.submit("a", lambda x: x * 2, 21).result(timeout=10) == 42


def test_closing_cancels_what_waits_and_lets_the_running_one_finish():
    pool, started, release = CompileTurns(1), threading.Event(), threading.Event()

    def hold(_):
        started.set()
        return release.wait(5)

    running = pool.submit("a", hold, None)
    waiting = pool.submit("b", lambda x: x, 1)
    assert started.wait(5)
    closer = threading.Thread(target=pool.close)
    closer.start()
    release.set()
    closer.join(timeout=10)
    assert running.result(timeout=1) is True and waiting.cancelled()
    with pytest.raises(RuntimeError):
        pool.submit("a", lambda x: x, 1)
