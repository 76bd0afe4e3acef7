"""A stored response's cancel holds: marked at once, never undone by the process that runs
it, and what that process made kept with it."""

from __future__ import annotations

import pytest

from requestlogs.facade import (
    ResponseWrite,
    stored_response_cancel,
    stored_response_get,
    stored_responses_write,
)
from tests.factories import tenant_factory

pytestmark = pytest.mark.django_db


def _write(tenant, status: str, output: list, *, first: bool = False) -> None:
    response = {"id": "resp_1", "object": "response", "status": status, "output": output,
                "background": True}
    extra = {"retention_days": 1, "depth": 0} if first else {}
    [outcome] = stored_responses_write(writes=[ResponseWrite(
        tenant_id=tenant.pk, response=response, history_before=[], turn=[], **extra)])
    assert outcome is None


TEXT = [{"type": "message", "content": [{"type": "output_text", "text": "made so far"}]}]


def test_a_cancel_marks_a_running_response_and_its_process_cannot_undo_it():
    tenant = tenant_factory()
    _write(tenant, "queued", [], first=True)
    _write(tenant, "in_progress", [])
    marked = stored_response_cancel(tenant_id=tenant.pk, response_id="resp_1")
    assert marked.status == marked.response["status"] == "cancelled"

    _write(tenant, "in_progress", [])  # a late progress write of the running process
    assert stored_response_get(tenant_id=tenant.pk, response_id="resp_1").status == "cancelled"

    _write(tenant, "completed", TEXT)  # it ended before it saw the cancel
    stored = stored_response_get(tenant_id=tenant.pk, response_id="resp_1")
    assert (stored.status, stored.response["status"]) == ("cancelled", "cancelled")
    assert stored.response["output"] == TEXT  # what it made is kept


def test_an_ended_response_is_not_cancelled_and_another_tenants_is_not_found():
    tenant, other = tenant_factory(), tenant_factory()
    _write(tenant, "queued", [], first=True)
    _write(tenant, "completed", TEXT)
    assert stored_response_cancel(tenant_id=other.pk, response_id="resp_1") is None
    ended = stored_response_cancel(tenant_id=tenant.pk, response_id="resp_1")
    assert ended.status == "completed" and ended.response["output"] == TEXT
