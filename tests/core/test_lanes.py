"""Each tenant's share of a lane, held in Redis across every worker (core/lanes.py)."""

from __future__ import annotations

import time

import pytest

from core import lanes


def test_a_tenant_holds_at_most_its_share_and_others_are_not_held_back(redis_client):
    with lanes.tenant_slot("exports", 1, cap=2, lease_s=60), \
            lanes.tenant_slot("exports", 1, cap=2, lease_s=60):
        with pytest.raises(lanes.TenantBusy) as busy:
            with lanes.tenant_slot("exports", 1, cap=2, lease_s=60):
                pass
        assert (busy.value.lane, busy.value.tenant_id) == ("exports", 1)
        with lanes.tenant_slot("exports", 2, cap=2, lease_s=60):  # another tenant
            assert lanes.slots_held("exports", 2) == 1
        with lanes.tenant_slot("adapters", 1, cap=2, lease_s=60):  # another lane
            pass
        assert lanes.slots_held("exports", 1) == 2
    assert lanes.slots_held("exports", 1) == 0  # released on the way out


def test_a_slot_is_released_when_the_work_fails(redis_client):
    with pytest.raises(RuntimeError):
        with lanes.tenant_slot("exports", 1, cap=1, lease_s=60):
            raise RuntimeError("the export broke")
    with lanes.tenant_slot("exports", 1, cap=1, lease_s=60):
        pass


def test_a_dead_holders_slot_lapses_after_its_lease(redis_client):
    held = lanes.tenant_slot("exports", 1, cap=1, lease_s=0.3)
    held.__enter__()  # its worker dies here: never released
    with pytest.raises(lanes.TenantBusy):
        with lanes.tenant_slot("exports", 1, cap=1, lease_s=60):
            pass
    deadline = time.monotonic() + 5
    while lanes.slots_held("exports", 1):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with lanes.tenant_slot("exports", 1, cap=1, lease_s=60):
        assert 0 < redis_client.pttl(lanes.slots_key("exports", 1)) <= 60_000  # it expires
