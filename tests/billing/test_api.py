"""What billing's API answers: usage buckets (OpenAI's usage API shape), the price book,
spend and its cap, invoices; bad input is a 400 in the OpenAI shape and changes nothing."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from billing import services
from billing.models import Price, SpendCap
from tenants.models import AuditEvent, Role
from tests.billing.conftest import T0, event, prices
from tests.factories import key_factory, member_factory, tenant_factory, user_factory

pytestmark = pytest.mark.django_db
DAY = 86400
START = int(T0.timestamp())


@pytest.fixture
def acme():
    prices()
    prices(model="n", inp="2.00", cached="1.00", out="4.00")
    tenant = tenant_factory("acme")
    key = key_factory(tenant)
    services.usage_records_ingest(events=[
        event(tenant, rid="d0-m", at=T0 + timedelta(hours=1)),
        event(tenant, rid="d0-n", at=T0 + timedelta(hours=1, minutes=5), model="n"),
        event(tenant, rid="d0-k", at=T0 + timedelta(hours=3), api_key_id=key.id),
        event(tenant, rid="d2-m", at=T0 + timedelta(days=2, hours=5),
              adapter="acme/support@1"),
    ])
    tenant.key = key
    return tenant


@pytest.fixture
def owner(acme) -> APIClient:
    client = APIClient()
    client.force_login(member_factory(acme, Role.OWNER))
    return client


def _usage(client, **params):
    r = client.get("/api/v1/tenants/acme/usage", params)
    assert r.status_code == 200, r.content
    return r.json()


def test_daily_usage_has_a_bucket_per_day_even_when_empty(owner):
    page = _usage(owner, start_time=START, end_time=START + 3 * DAY)
    assert page["object"] == "page" and page["has_more"] is False and page["next_page"] is None
    assert [b["start_time"] for b in page["data"]] == [START, START + DAY, START + 2 * DAY]
    first, empty, third = page["data"]
    assert empty["results"] == []
    [day0] = first["results"]
    assert day0 == {"object": "usage.result", "num_model_requests": 3, "input_tokens": 3000,
                    "input_cached_tokens": 600, "output_tokens": 150,
                    "amount": {"value": "0.004000", "currency": "USD"},
                    "model": None, "adapter": None, "api_key_id": None}
    assert third["results"][0]["num_model_requests"] == 1


def test_usage_groups_by_model_adapter_and_key(owner, acme):
    page = _usage(owner, start_time=START, end_time=START + DAY, group_by="model,api_key_id")
    rows = {(r["model"], r["api_key_id"]): r["num_model_requests"]
            for r in page["data"][0]["results"]}
    assert rows == {("m", None): 1, ("m", acme.key.id): 1, ("n", None): 1}
    page = _usage(owner, start_time=START, end_time=START + 3 * DAY, group_by=["adapter"])
    adapters = [r["adapter"] for b in page["data"] for r in b["results"]]
    assert adapters == ["", "acme/support@1"]


def test_hourly_usage_comes_from_the_ledger(owner):
    page = _usage(owner, start_time=START, end_time=START + 4 * 3600, bucket_width="1h",
                  group_by="model")
    counts = [[(r["model"], r["num_model_requests"]) for r in b["results"]]
              for b in page["data"]]
    assert counts == [[], [("m", 1), ("n", 1)], [], [("m", 1)]]


def test_usage_filters_by_model_and_key(owner, acme):
    page = _usage(owner, start_time=START, end_time=START + 3 * DAY, models="n")
    assert sum(r["num_model_requests"] for b in page["data"] for r in b["results"]) == 1
    page = _usage(owner, start_time=START, end_time=START + 3 * DAY,
                  **{"api_key_ids[]": acme.key.id})
    assert sum(r["num_model_requests"] for b in page["data"] for r in b["results"]) == 1


def test_usage_pages_through_a_long_range(owner):
    first = _usage(owner, start_time=START + 5, end_time=START + 3 * DAY, limit=2)
    assert [b["start_time"] for b in first["data"]] == [START, START + DAY]
    assert first["has_more"] and first["next_page"] == str(START + 2 * DAY)
    rest = _usage(owner, start_time=START + 5, end_time=START + 3 * DAY, limit=2,
                  page=first["next_page"])
    assert [b["start_time"] for b in rest["data"]] == [START + 2 * DAY]
    assert rest["has_more"] is False


def test_without_an_end_the_range_is_one_page_from_the_start(owner):
    page = _usage(owner, start_time=START + 3600, bucket_width="1d")
    assert [b["start_time"] for b in page["data"]] == [START + i * DAY for i in range(7)]
    assert page["has_more"] is False


def test_a_huge_range_answers_one_bounded_page(owner):
    page = _usage(owner, start_time=0, end_time=4_102_444_800, bucket_width="1d", limit=31)
    assert len(page["data"]) == 31 and page["has_more"]


@pytest.mark.parametrize("params, param", [
    ({}, "start_time"),
    ({"start_time": "soon"}, "start_time"),
    ({"start_time": -1}, "start_time"),
    ({"start_time": 10**13}, "start_time"),
    ({"start_time": START, "end_time": START}, "end_time"),
    ({"start_time": START, "end_time": START - DAY}, "end_time"),
    ({"start_time": START, "bucket_width": "1m"}, "bucket_width"),
    ({"start_time": START, "group_by": "user_id"}, "group_by"),
    ({"start_time": START, "limit": 32}, "limit"),
    ({"start_time": START, "bucket_width": "1h", "limit": 169}, "limit"),
    ({"start_time": START, "limit": 0}, "limit"),
    ({"start_time": START, "page": "12"}, "page"),
    ({"start_time": START, "page": "not-a-page"}, "page"),
    ({"start_time": START, "page": str(START - DAY)}, "page"),
    ({"start_time": START, "api_key_ids": "x"}, "api_key_ids"),
    ({"start_time": START, "colour": "red"}, "colour"),
])
def test_bad_usage_queries_are_400_naming_the_parameter(owner, params, param):
    r = owner.get("/api/v1/tenants/acme/usage", params)
    assert r.status_code == 400, r.content
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


# --- the price book ------------------------------------------------------------------------

def _staff() -> APIClient:
    client = APIClient()
    client.force_login(user_factory(is_staff=True))
    return client


def _price(**kw):
    return {"model": "m", "input_per_million": "1.25", "cached_input_per_million": "0.5",
            "output_per_million": "5", **kw}


def test_operators_add_prices_which_are_audited_and_everyone_reads(acme, owner):
    staff = _staff()
    later = (timezone.now() + timedelta(days=1)).replace(microsecond=0)
    r = staff.post("/api/v1/prices", _price(effective_from=later.isoformat()), format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["input_per_million"] == "1.250000" and body["currency"] == "USD"
    assert AuditEvent.objects.filter(action="price.create", target_id=str(body["id"])).exists()
    listed = owner.get("/api/v1/prices", {"model": "m"}).json()["data"]
    assert [p["id"] for p in listed][-1] == body["id"]
    assert owner.get("/api/v1/prices", {"model": "nothing"}).json()["data"] == []


def test_an_embedding_price_is_optional_and_null_means_the_input_price(acme):
    staff = _staff()
    later = timezone.now() + timedelta(days=1)
    r = staff.post("/api/v1/prices", _price(model="e", embedding_per_million="0.02",
                                            effective_from=later.isoformat()), format="json")
    assert r.status_code == 201, r.content
    assert r.json()["embedding_per_million"] == "0.020000"
    assert Price.objects.get(pk=r.json()["id"]).embedding_per_million == Decimal("0.02")
    assert AuditEvent.objects.get(action="price.create", target_id=str(r.json()["id"])
                                  ).after["embedding_per_million"] == "0.020000"
    r = staff.post("/api/v1/prices", _price(model="f"), format="json")
    assert r.status_code == 201 and r.json()["embedding_per_million"] is None
    assert Price.objects.get(pk=r.json()["id"]).embedding_per_million is None


@pytest.mark.parametrize("body, param, status", [
    (_price(effective_from="2020-01-01T00:00:00Z"), "effective_from", 400),
    (_price(input_per_million="-1"), "input_per_million", 400),
    (_price(output_per_million="0.0000001"), "output_per_million", 400),
    (_price(embedding_per_million="-0.01"), "embedding_per_million", 400),
    (_price(embedding_per_million="0.0000001"), "embedding_per_million", 400),
    (_price(currency="EUR"), "currency", 400),
    (_price(currency="usd"), "currency", 400),
    (_price(model=""), "model", 400),
    (_price(surprise=1), "surprise", 400),
    ({"model": "m"}, "input_per_million", 400),
])
def test_bad_prices_are_refused_and_change_nothing(acme, body, param, status):
    count = Price.objects.count()
    r = _staff().post("/api/v1/prices", body, format="json")
    assert r.status_code == status, r.content
    assert r.json()["error"]["param"] == param
    assert Price.objects.count() == count


def test_a_backdated_price_is_a_400_that_names_effective_from(acme):
    hour_ago = timezone.now() - timedelta(hours=1)
    r = _staff().post("/api/v1/prices", _price(effective_from=hour_ago.isoformat()),
                      format="json")
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "'effective_from' is in the past: a price never changes what was already "
                   "billed", "type": "invalid_request_error", "param": "effective_from",
        "code": "invalid_value"}


def test_a_price_is_never_edited_only_superseded(acme):
    staff = _staff()
    at = (timezone.now() + timedelta(days=2)).replace(microsecond=0).isoformat()
    assert staff.post("/api/v1/prices", _price(effective_from=at), format="json"
                      ).status_code == 201
    r = staff.post("/api/v1/prices", _price(effective_from=at, input_per_million="9"),
                   format="json")
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    assert staff.patch("/api/v1/prices", _price(), format="json").status_code == 405


# --- spend, its cap and invoices -----------------------------------------------------------

def test_spend_shows_this_period_against_the_cap(acme, owner):
    now = timezone.now()
    services.usage_records_ingest(events=[event(acme, rid="now", at=now,
                                                completion_tokens=1_000_000)])
    r = _staff().patch("/api/v1/tenants/acme/spend-cap", {"monthly_limit": "10.00"},
                       format="json")
    assert r.status_code == 200, r.content
    body = owner.get("/api/v1/tenants/acme/spend").json()
    assert body["spent"] == "2.000900" and body["cap"] == "10.00"
    assert body["remaining"] == "7.999100" and body["cap_source"] == "tenant"
    assert body["currency"] == "USD"
    r = _staff().patch("/api/v1/tenants/acme/spend-cap", {"inherit": True}, format="json")
    assert r.json()["cap"] is None and r.json()["cap_source"] is None


@pytest.mark.parametrize("body, param", [
    ({}, "monthly_limit"),
    ({"monthly_limit": "5", "inherit": True}, "monthly_limit"),
    ({"monthly_limit": "-5"}, "monthly_limit"),
    ({"monthly_limit": "1.234"}, "monthly_limit"),
    ({"monthly_limit": "1e20"}, "monthly_limit"),
    ({"monthly_limit": "lots"}, "monthly_limit"),
    ({"inherit": "maybe"}, "inherit"),
])
def test_bad_caps_are_400_and_change_nothing(acme, body, param):
    before = (SpendCap.objects.count(), AuditEvent.objects.count())
    r = _staff().patch("/api/v1/tenants/acme/spend-cap", body, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["error"]["param"] == param
    assert (SpendCap.objects.count(), AuditEvent.objects.count()) == before


def test_operators_set_a_plans_cap(acme):
    r = _staff().patch(f"/api/v1/plans/{acme.plan.slug}/spend-cap", {"monthly_limit": "50"},
                       format="json")
    assert r.status_code == 200 and r.json() == {"plan": acme.plan.slug,
                                                 "monthly_limit": "50.00"}
    assert _staff().patch("/api/v1/plans/no-plan/spend-cap", {"monthly_limit": "5"},
                          format="json").status_code == 404


def test_invoices_list_and_detail_with_lines(acme, owner):
    listed = owner.get("/api/v1/tenants/acme/invoices").json()
    march = next(i for i in listed["data"] if i["period_start"] == "2026-03-01")
    assert march["status"] == "draft" and march["number"].startswith("ATR-202603-")
    detail = owner.get(f"/api/v1/tenants/acme/invoices/{march['id']}").json()
    assert detail == march
    classes = {(x["model"], x["adapter"], x["token_class"]) for x in detail["lines"]}
    assert ("n", "", "output") in classes and ("m", "acme/support@1", "input") in classes
    assert Decimal(detail["total"]) == sum(Decimal(x["amount"]) for x in detail["lines"])
    services.invoice_finalize(invoice_id=march["id"], now=datetime(2026, 5, 1, tzinfo=UTC))
    final = owner.get(f"/api/v1/tenants/acme/invoices/{march['id']}").json()
    assert final["status"] == "finalized" and final["lines"] == detail["lines"]
    assert owner.get("/api/v1/tenants/acme/invoices/999999").status_code == 404


def test_one_requests_charge_is_found_by_the_id_its_client_got(acme, owner):
    services.usage_records_ingest(events=[
        event(acme, rid="chatcmpl-5f3c", at=T0 + timedelta(days=4), completion_tokens=7),
        # Written before ids carried their prefix: the ledger holds the hex part alone.
        event(acme, rid="0a1b2c", at=T0 + timedelta(days=4))])
    r = owner.get("/api/v1/tenants/acme/usage/requests/chatcmpl-5f3c")
    assert r.status_code == 200, r.content
    assert r.json() == {
        "object": "usage.record", "request_id": "chatcmpl-5f3c",
        "occurred_at": START + 4 * DAY, "billing_period": "2026-03-01", "model": "m",
        "adapter": "", "api_key_id": None, "api_key_prefix": "", "finish_reason": "",
        "input_tokens": 1000, "input_cached_tokens": 200, "output_tokens": 7,
        "price_class": "interactive", "amount": {"value": "0.000914", "currency": "USD"}}
    assert owner.get("/api/v1/tenants/acme/usage/requests/cmpl-0a1b2c").json()[
        "request_id"] == "0a1b2c"
    for unknown in ("chatcmpl-0a1b", "cmpl-5f3c", "5f3c0"):
        assert owner.get(f"/api/v1/tenants/acme/usage/requests/{unknown}").status_code == 404


def test_money_is_in_the_upper_case_iso_code_everywhere(acme, owner, export_dir):
    usage = _usage(owner, start_time=START, end_time=START + DAY)
    assert {r["amount"]["currency"] for b in usage["data"] for r in b["results"]} == {"USD"}
    assert owner.get("/api/v1/tenants/acme/usage/requests/d0-m").json()["amount"][
        "currency"] == "USD"
    assert owner.get("/api/v1/tenants/acme/spend").json()["currency"] == "USD"
    assert {i["currency"] for i in owner.get("/api/v1/tenants/acme/invoices").json()["data"]
            } == {"USD"}
    assert {p["currency"] for p in owner.get("/api/v1/prices").json()["data"]} == {"USD"}
    files = {}
    for kind, fmt in (("ledger", "csv"), ("ledger", "jsonl"), ("invoices", "csv"),
                      ("invoices", "jsonl"), ("meter_events", "jsonl")):
        r = owner.post("/api/v1/tenants/acme/exports", {
            "kind": kind, "format": fmt, "start": "2026-03-01T00:00:00Z",
            "end": "2026-04-01T00:00:00Z"}, format="json")
        assert r.status_code == 202, r.content
        services.export_build(export_id=r.json()["id"])  # the Celery task's work
        files[kind, fmt] = b"".join(owner.get(
            f"/api/v1/tenants/acme/exports/{r.json()['id']}/content").streaming_content
        ).decode()
    for kind in ("ledger", "invoices"):
        rows = list(csv.DictReader(io.StringIO(files[kind, "csv"])))
        assert rows and {row["currency"] for row in rows} == {"USD"}
        lines = [json.loads(x) for x in files[kind, "jsonl"].splitlines()]
        assert lines and {x["currency"] for x in lines} == {"USD"}
    meters = [json.loads(x) for x in files["meter_events", "jsonl"].splitlines()]
    assert meters and {m["payload"]["currency"] for m in meters} == {"USD"}


def test_openapi_schema_lists_the_billing_operations(client):
    spec = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    operations = {op["operationId"] for path in spec["paths"].values() for op in path.values()
                  if isinstance(op, dict) and "operationId" in op}
    assert {"usage_list", "usage_record_detail", "spend_detail", "spend_cap_update",
            "invoice_list", "invoice_detail", "export_create", "export_content",
            "price_create", "price_list"} <= operations

