"""Writing a log (once, redacted, under the tenant's policy) and retention."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from requestlogs.models import RedactionPattern, RequestLog
from requestlogs.services import (
    RequestLogEntry,
    log_policy_update,
    redaction_pattern_create,
    request_log_record,
)
from requestlogs.tasks import request_logs_expire_task
from tenants.access import SYSTEM
from tests.factories import tenant_factory

pytestmark = pytest.mark.django_db


def _entry(tenant, **overrides) -> RequestLogEntry:
    values = dict(request_id=uuid.uuid4().hex, tenant_id=tenant.pk, endpoint="completion",
                  transport="http", model="tiny-llama", status=200,
                  prompt="employee EMP-123456, card 4111 1111 1111 1111",
                  completion="ok EMP-654321")
    values.update(overrides)
    return RequestLogEntry(**values)


def test_a_request_is_logged_once_whatever_is_retried():
    tenant = tenant_factory()
    entry = _entry(tenant)
    assert request_log_record(entry=entry) is True
    assert request_log_record(entry=entry) is False
    assert RequestLog.objects.filter(request_id=entry.request_id).count() == 1


def test_bodies_are_dropped_unless_the_tenant_keeps_them():
    tenant = tenant_factory()
    request_log_record(entry=_entry(tenant, request_id="a" * 32))
    log_policy_update(tenant=tenant, actor=SYSTEM, log_bodies=True)
    request_log_record(entry=_entry(tenant, request_id="b" * 32))
    log_policy_update(tenant=tenant, actor=SYSTEM, log_bodies=False)
    request_log_record(entry=_entry(tenant, request_id="c" * 32))
    kept = dict(RequestLog.objects.values_list("request_id", "prompt"))
    assert kept["a" * 32] is None and kept["c" * 32] is None
    assert kept["b" * 32] == "employee EMP-123456, card [CARD]"


def test_the_tenants_own_patterns_redact_its_bodies_and_no_one_elses():
    mine, theirs = tenant_factory(), tenant_factory()
    redaction_pattern_create(tenant=mine, actor=SYSTEM, name="EMPLOYEE", pattern=r"EMP-\d{6}")
    for tenant in (mine, theirs):
        log_policy_update(tenant=tenant, actor=SYSTEM, log_bodies=True)
        request_log_record(entry=_entry(tenant))
    logs = {log.tenant_id: log for log in RequestLog.objects.all()}
    assert logs[mine.pk].prompt == "employee [EMPLOYEE], card [CARD]"
    assert logs[mine.pk].completion == "ok [EMPLOYEE]"
    assert logs[theirs.pk].prompt == "employee EMP-123456, card [CARD]"


def test_a_stored_pattern_the_rules_now_refuse_means_no_bodies_are_kept():
    tenant = tenant_factory()
    log_policy_update(tenant=tenant, actor=SYSTEM, log_bodies=True)
    # Written past the service, as if saved under older, looser rules.
    RedactionPattern.objects.create(tenant=tenant, name="OLD", pattern=r"(a+)+$")
    request_log_record(entry=_entry(tenant))
    log = RequestLog.objects.get()
    assert log.prompt is None and log.completion is None and log.status == 200


def test_chat_messages_are_kept_as_structure_with_every_string_redacted():
    tenant = tenant_factory()
    log_policy_update(tenant=tenant, actor=SYSTEM, log_bodies=True)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "-----BEGIN RSA PRIVATE KEY-----\nMIIBOgIBAAJBAKj34GkxFhD9\n"
                                 "-----END RSA PRIVATE KEY-----"}]}]
    request_log_record(entry=_entry(tenant, endpoint="chat", prompt=messages))
    assert RequestLog.objects.get().prompt == [
        {"role": "user", "content": [{"type": "text", "text": "[PRIVATE_KEY]"}]}]


def test_retention_deletes_what_is_older_than_each_tenants_period():
    short, default = tenant_factory(), tenant_factory()
    log_policy_update(tenant=short, actor=SYSTEM, retention_days=7)
    now = datetime.now(UTC)

    def at(tenant, days_ago: float) -> str:
        entry = _entry(tenant, created_at=(now - timedelta(days=days_ago)).timestamp())
        request_log_record(entry=entry)
        return entry.request_id

    kept = {at(short, 1), at(short, 6.9), at(default, 8), at(default, 29.9)}
    at(short, 7.1)
    at(short, 100)
    at(default, 30.1)
    assert request_logs_expire_task() == 3
    assert set(RequestLog.objects.values_list("request_id", flat=True)) == kept
    assert request_logs_expire_task() == 0  # idempotent
