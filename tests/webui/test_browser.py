"""The console in a real Chromium against the real ASGI app (uvicorn), Redis, the database,
a Celery worker and an engine worker, as a person uses it.

One browser for the module. NOTE: Playwright's sync API keeps an event loop marked as
running in this thread while it is started, so Django's guard against ORM calls inside
an event loop would refuse the tests' own setup; `_orm_in_tests` lifts that guard for
these tests only (the live server's threads are unaffected in behaviour).
"""

from __future__ import annotations

import io
import os
import time
import zipfile
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from openai import AuthenticationError, OpenAI
from playwright.sync_api import expect

from tests.live import make_tenant_key, start_engine
from tests.webui.conftest import build_world, screenshot, sign_in

PASSWORD = "correct horse battery staple"


@pytest.fixture(autouse=True)
def _orm_in_tests(monkeypatch, settings):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    # Signing in hashes passwords; the fast hasher keeps that out of the tests' time.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    assert os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] == "true"


@pytest.fixture
def world(transactional_db, redis_client):  # noqa: F811 - the live server's database
    world = build_world()
    for user in [*world.people.values(), world.staff, world.outsider]:
        user.set_password(PASSWORD)
        user.save(update_fields=["password"])
    return world


def _errors(page) -> list[str]:
    """Console errors (a script failing, a CSP violation) collected while the page lives."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return errors


# --- keys ----------------------------------------------------------------------------------

def test_a_key_is_shown_once_then_only_its_prefix_and_revoking_it_stops_the_api(
        new_page, world, api_server):
    page = new_page()
    errors = _errors(page)
    sign_in(page, "owner@acme.test", PASSWORD)
    expect(page).to_have_url(f"{api_server}/console/t/acme/")  # one tenant: straight in
    page.get_by_role("link", name="API keys").click()
    page.get_by_label("Name").fill("ci backend")
    page.get_by_role("button", name="Create key").click()

    secret = page.locator("#new-secret")
    expect(secret).to_be_visible()
    plaintext = secret.input_value()
    assert plaintext.startswith("atr_") and len(plaintext) > 30
    page.get_by_role("button", name="Copy").click()
    expect(page.locator(".copy-status")).to_have_text("Copied.")
    screenshot(page, "keys-created")

    client = OpenAI(base_url=f"{api_server}/v1", api_key=plaintext, max_retries=0)
    assert [m.id for m in client.models.list().data][0] == "tiny-llama"

    page.goto("/console/t/acme/keys")
    assert plaintext not in page.content()
    row = page.locator("tr", has_text="ci backend")
    expect(row.locator("code")).to_have_text(f"{plaintext[:12]}…")
    screenshot(page, "keys")

    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_text("Manage").click()
    row.get_by_role("button", name="Revoke").click()
    expect(page.locator(".message.success")).to_contain_text("revoked")
    expect(page.locator("tr", has_text="ci backend").locator(".status")).to_have_text("revoked")
    with pytest.raises(AuthenticationError):
        client.models.list()
    assert errors == []


def test_a_viewer_is_not_offered_key_creation_and_cannot_post_it(new_page, world):
    page = new_page()
    sign_in(page, "viewer@acme.test", PASSWORD)
    page.goto("/console/t/acme/keys")
    expect(page.get_by_role("heading", name="Keys", exact=True)).to_be_visible()
    expect(page.get_by_role("heading", name="Create a key")).to_have_count(0)
    expect(page.get_by_role("link", name="Audit log")).to_have_count(0)
    token = page.locator('meta[name="csrf-token"]').get_attribute("content")
    response = page.request.post("/console/t/acme/keys", form={
        "csrfmiddlewaretoken": token, "name": "sneaky", "scopes": "inference"})
    assert response.status == 403
    assert not world.acme.api_keys.filter(name="sneaky").exists()
    # ...and another tenant is not there at all.
    assert page.goto("/console/t/other/").status == 404


# --- usage and billing ---------------------------------------------------------------------

def _ledger(tenant, key_id: int, key_prefix: str) -> None:
    """Three requests this period at 2.00 each (1M input tokens at 1.00/M, 0.5M output at
    2.00/M), written through the billing services."""
    from django.utils import timezone

    from billing.periods import day_start, period_of
    from billing.services import UsageEvent, price_create, usage_records_write

    now = timezone.now()
    price_create(model="tiny-llama", input_per_million=Decimal("1.00"),
                 cached_input_per_million=Decimal("0.50"), output_per_million=Decimal("2.00"),
                 effective_from=now - timedelta(days=40), now=now - timedelta(days=40))
    earlier = max(day_start(period_of(now)), now - timedelta(days=1))
    usage_records_write(events=[UsageEvent(
        request_id=f"ledger-{i}", tenant_id=tenant.pk, model="tiny-llama",
        prompt_tokens=1_000_000, cached_tokens=0, completion_tokens=500_000, occurred_at=at,
        api_key_id=key_id, api_key_prefix=key_prefix) for i, at in enumerate([now, now, earlier])])


def test_usage_and_billing_pages_show_what_the_ledger_holds(new_page, world):
    from tenants.selectors import api_key_get

    key = api_key_get(tenant=world.acme, key_id=world.objects["key_id"])
    _ledger(world.acme, key.pk, key.prefix)
    # The world's own request (no key, model "m") was costed before any price existed: 0.

    page = new_page()
    errors = _errors(page)
    sign_in(page, "owner@acme.test", PASSWORD)
    expect(page.locator('[data-stat="requests"]')).to_have_text("4")  # with the world's own
    expect(page.locator('[data-stat="spend"]')).to_have_text("6.00 USD")
    expect(page.locator(".chart svg rect.bar")).to_have_count(30)
    screenshot(page, "overview")

    page.get_by_role("link", name="Usage", exact=True).click()
    expect(page.locator('[data-stat="output"]')).to_have_text("1,500,050")
    expect(page.locator('[data-stat="cost"]')).to_have_text("6.00 USD")
    by_key = page.locator("#by-key-table tbody tr", has_text="main")
    expect(by_key.locator("td").nth(0)).to_have_text("3")
    expect(by_key.locator("td").nth(3)).to_have_text("6.00")
    by_model = page.locator("#by-model-table tbody tr", has_text="tiny-llama")
    expect(by_model.locator("td").nth(1)).to_have_text("3,000,000")
    screenshot(page, "usage")

    page.get_by_role("link", name="Billing", exact=True).click()
    expect(page.locator('[data-stat="spent"]')).to_have_text("6.00 USD")
    expect(page.locator("#invoices [data-total]").first).to_have_text("6.00 USD")
    screenshot(page, "billing")
    page.locator("#invoices a").first.click()
    expect(page.locator("#invoice-lines tfoot [data-total]")).to_have_text("6.00")
    output_line = (page.locator("#invoice-lines tbody tr").filter(has_text="tiny-llama")
                   .filter(has_text="output"))
    expect(output_line.locator("td").nth(4)).to_have_text("1,500,000")
    screenshot(page, "invoice")
    assert errors == []


# --- adapters ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapter_zip(tiny_model_path, tmp_path_factory) -> Path:
    """A PEFT LoRA adapter of the tiny model, zipped as a person would upload it."""
    from tests.engine.lora_testing import train_adapter

    root = tmp_path_factory.mktemp("console-adapter")
    folder = train_adapter(tiny_model_path, root / "sql", seed=21, r=8, steps=1)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted(folder.iterdir()):
            archive.write(path, f"sql/{path.name}")
    target = root / "sql.zip"
    target.write_bytes(buffer.getvalue())
    return target


def test_an_uploaded_adapter_shows_progress_then_becomes_ready_live(
        new_page, world, adapter_store, celery_worker, adapter_zip):
    page = new_page()
    errors = _errors(page)
    sign_in(page, "developer@acme.test", PASSWORD)
    page.goto("/console/t/acme/adapters")
    expect(page.locator("[data-live]")).to_be_visible()  # the status socket is open
    page.get_by_label("Name").fill("summarizer")
    page.get_by_label("Adapter archive (.zip or .tar.gz)").set_input_files(str(adapter_zip))
    page.get_by_role("button", name="Upload").click()
    row = page.locator("tr", has_text="tiny-llama:summarizer@1")
    expect(row.locator("[data-status]")).to_have_text("ready", timeout=60_000)
    expect(row.locator("[data-rank]")).to_have_text("8")  # its facts, once validated
    expect(page.locator("[data-live]")).to_be_visible()
    screenshot(page, "adapters")
    adapter = world.acme.adapters.get(name="summarizer", version=1)
    assert adapter.status == "ready" and adapter.rank == 8
    assert errors == []


# --- the operator --------------------------------------------------------------------------

def test_the_operator_watches_the_fleet_live(new_page, world, api_server, served_model,
                                            tiny_model_path):
    page = new_page()
    errors = _errors(page)
    sign_in(page, "ops@atrium.test", PASSWORD)
    expect(page).to_have_url(f"{api_server}/console/operator/tenants")
    page.get_by_role("link", name="Engine fleet").click()
    expect(page.locator("[data-live]")).to_be_visible()
    expect(page.locator("#fleet-table tbody tr[data-empty]")).to_have_count(1)

    engine = start_engine(tiny_model_path, served_model, "console-engine")
    try:
        row = page.locator('tr[data-engine="console-engine"]')
        expect(row).to_be_visible()  # pushed over the socket: no reload
        expect(row.locator('[data-field="generated"]')).to_have_text("0")
        key = make_tenant_key("fleetco")
        OpenAI(base_url=f"{api_server}/v1", api_key=key.key, max_retries=0).completions.create(
            model=served_model, prompt="Once upon a time", max_tokens=8, temperature=0)
        expect(row.locator('[data-field="generated"]')).not_to_have_text("0")
        screenshot(page, "fleet")
    finally:
        engine.stop.set()
        engine.thread.join(timeout=30)
    expect(page.locator('tr[data-engine="console-engine"]')).to_have_count(0, timeout=15_000)
    assert errors == []


# --- every page, for the record ------------------------------------------------------------

TENANT_PAGES = ["", "keys", "usage", "billing", "adapters", "logs", "quotas", "members", "audit"]
OPERATOR_PAGES = ["tenants", "tenants/acme", "plans", "plans/default", "prices", "adapters",
                  "fleet", "health"]


def test_every_page_renders_without_a_script_or_policy_error(new_page, world, api_server):
    page = new_page()
    errors = _errors(page)
    page.goto("/console/login")
    screenshot(page, "login")
    sign_in(page, "owner@acme.test", PASSWORD)
    for name in TENANT_PAGES:
        response = page.goto(f"/console/t/acme/{name}")
        assert response.status == 200, name
        expect(page.locator("h1")).to_be_visible()
        screenshot(page, f"tenant-{name or 'overview'}")
    rid = world.objects["request_id"]
    assert page.goto(f"/console/t/acme/logs/{rid}").status == 200
    screenshot(page, "tenant-log")
    assert errors == []
    assert page.goto("/console/operator/tenants").status == 403
    errors.clear()  # the 403 itself is reported as a failed load

    operator = new_page()
    errors += _errors(operator)
    sign_in(operator, "ops@atrium.test", PASSWORD)
    for name in OPERATOR_PAGES:
        assert operator.goto(f"/console/operator/{name}").status == 200, name
        screenshot(operator, f"operator-{name.replace('/', '-')}")
    assert httpx.get(f"{api_server}/static/webui/console.css").status_code == 200
    assert errors == []


# A table overflows when it runs past its wrapper (scrolls), or its wrapper past the window
# (is cut off: a page wider than the window).
OVERFLOWING_TABLES = """() => [...document.querySelectorAll('.table-wrap')]
    .filter(w => w.scrollWidth > w.clientWidth + 1
                 || w.getBoundingClientRect().right > document.documentElement.clientWidth)
    .map(w => (w.querySelector('table') || w).id || 'a table')"""


def _engine_reporting(redis_client) -> None:
    """One live engine with figures in every column the fleet and health pages show."""
    from engine import protocol
    from engine.metrics import EngineMetrics

    metrics = EngineMetrics()
    for seconds in (0.05, 0.3, 1.7):
        metrics.ttft.observe(seconds)
        metrics.itl.observe(seconds / 20)
    now = time.time()
    beat = protocol.EngineHeartbeat(
        engine_id="atrium-engine-7d9f8c6b5-x2k4p-1-a1b2c3", model="a-long-model-name-7b-instruct",
        started_at=now - 60, sent_at=now, running=12, waiting=345, stats={
            "tokens_generated": 123_456_789, "engine": {
                "kv_usage": 0.875, "kv_blocks_used": 3500, "kv_blocks_total": 4000,
                "prefix_cache_hit_rate": 0.4321, "generation_tokens_per_s": 12345.6,
                "prompt_tokens_per_s": 54321.0, "adapters_in_slots": ["ab" * 32, "cd" * 32],
                "ttft": metrics.ttft.to_dict(), "itl": metrics.itl.to_dict()}})
    redis_client.zadd(protocol.ENGINES_ZSET, {beat.engine_id: now})
    redis_client.set(protocol.engine_key(beat.engine_id), beat.encode(), ex=30)


def _price_book() -> None:
    """A long model name with a surcharge and an embedding price, and one without."""
    from billing.services import price_create

    for adapter, embedding in (("", Decimal("0.020000")), ("acme/support-v2@12", None)):
        price_create(model="a-long-model-name-7b-instruct", adapter=adapter,
                     input_per_million=Decimal("123.456789"),
                     cached_input_per_million=Decimal("61.728394"),
                     output_per_million=Decimal("246.913578"), embedding_per_million=embedding)


def test_every_table_fits_a_1280_px_window(new_page, world, redis_client):
    _engine_reporting(redis_client)
    _price_book()
    page = new_page(viewport=(1280, 800))
    sign_in(page, "ops@atrium.test", PASSWORD)
    for name in OPERATOR_PAGES:
        page.goto(f"/console/operator/{name}")
        screenshot(page, f"fit-operator-{name.replace('/', '-')}")
        assert page.evaluate(OVERFLOWING_TABLES) == [], name
    for name in TENANT_PAGES:
        page.goto(f"/console/t/acme/{name}")
        assert page.evaluate(OVERFLOWING_TABLES) == [], name
