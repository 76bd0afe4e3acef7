"""The console's tests: the platform's live-server fixtures, one Chromium for the session,
and a small world of tenants, people and their data built through the services."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.db import transaction

from tests.live import (  # noqa: F401
    adapter_store,
    api_server,
    celery_worker,
    redis_client,
    served_model,
)

ARTIFACTS = Path(os.environ.get("ATRIUM_TEST_ARTIFACTS", "test-artifacts")) / "screenshots"
CHROMIUM = os.environ.get("ATRIUM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking"]


@dataclass
class World:
    """Tenant acme with one person per role and one of each thing; tenant other likewise
    thin (an owner and one of each object), to prove acme's people never reach it."""

    acme: object
    other: object
    people: dict[str, object]  # role -> user, in acme
    staff: object
    outsider: object  # other's owner
    objects: dict[str, int]  # acme's object ids by kind
    other_objects: dict[str, int]


def _objects(tenant, owner) -> dict[str, int]:
    from adapters.models import Adapter
    from batches.services import file_create
    from billing.models import Budget, Export, Invoice, WebhookEndpoint
    from billing.services import usage_records_write
    from requestlogs.services import RequestLogEntry, request_log_record
    from tenants.access import Actor
    from tenants.models import Membership
    from tenants.services import api_key_create, invitation_create
    from tests.billing.conftest import event

    actor = Actor(user_id=owner.pk, user_email=owner.email)
    key, _ = api_key_create(tenant=tenant, name="main", scopes=["inference"], created_by=owner,
                            actor=actor)
    usage_records_write(events=[event(tenant, at=datetime.now(UTC))])
    invoice = Invoice.objects.for_tenant(tenant).first()
    export = Export.objects.create(tenant=tenant, kind="ledger", format="csv",
                                   start=datetime.now(UTC) - timedelta(days=2),
                                   end=datetime.now(UTC), status="pending")
    adapter = Adapter.objects.create(tenant=tenant, name="sql", version=1, base_model="m",
                                     status="ready")
    rid = f"{tenant.slug}0000feed"
    request_log_record(entry=RequestLogEntry(request_id=rid, tenant_id=tenant.pk,
                                             endpoint="chat", transport="http", model="m",
                                             status=200, api_key_id=key.pk))
    invitation, _ = invitation_create(tenant=tenant, email=f"new@{tenant.slug}.test",
                                      role="developer", actor=actor)
    member = Membership.objects.for_tenant(tenant).get(user=owner)
    budget = Budget.objects.create(tenant=tenant, scope="tenant", window="month",
                                   token_limit=10**6)
    endpoint = WebhookEndpoint.objects.create(tenant=tenant, url="https://hooks.test/",
                                              secret="whsec_")
    upload = file_create(tenant_id=tenant.pk, filename="in.jsonl", purpose="batch", data=(
        b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
        b'"body": {"model": "m", "prompt": "hi"}}\n'))
    return {"key_id": key.pk, "invoice_id": invoice.pk, "export_id": export.pk,
            "adapter_id": adapter.pk, "request_id": rid, "invitation_id": invitation.pk,
            "member_id": member.pk, "budget_id": budget.pk, "endpoint_id": endpoint.pk,
            "file_id": upload.id}


def build_world() -> World:
    from tests.factories import member_factory, tenant_factory, user_factory

    acme, other = tenant_factory("acme"), tenant_factory("other")
    people = {role: member_factory(acme, role, email=f"{role}@acme.test")
              for role in ("owner", "admin", "developer", "billing", "viewer")}
    outsider = member_factory(other, "owner", email="owner@other.test")
    staff = user_factory(email="ops@atrium.test", is_staff=True)
    objects = _objects(acme, people["owner"])
    # The member a manager acts on: the viewer (owners are only for owners to touch).
    objects["member_id"] = acme.memberships.get(user=people["viewer"]).pk
    return World(acme=acme, other=other, people=people, staff=staff, outsider=outsider,
                 objects=objects, other_objects=_objects(other, outsider))


@pytest.fixture(scope="module")
def _module_world(request: pytest.FixtureRequest, django_db_setup, django_db_blocker
                  ) -> Iterator[World]:
    """The world, built once for a module's tests in a transaction rolled back after its
    last one: each test runs in a savepoint inside it (the `db` fixture), so what one test
    changes is gone before the next, as with Django's setUpTestData (a module's 230 access
    walks: 45 s -> 14 s). A test that commits (transactional_db, a live server) would run
    inside that open transaction: a module using this world may hold none."""
    committing = [i.name for i in request.session.items
                  if getattr(i, "module", None) is request.module and _commits(i)]
    if committing:
        pytest.fail(f"{request.module.__name__} uses the shared world, so its tests cannot "
                    f"commit: {', '.join(committing)}", pytrace=False)
    with django_db_blocker.unblock(), transaction.atomic():
        yield build_world()
        transaction.set_rollback(True)


def _commits(item: pytest.Item) -> bool:
    marker = item.get_closest_marker("django_db")
    return bool({"transactional_db", "live_server", "api_server"}
                & set(getattr(item, "fixturenames", ()))
                or (marker and marker.kwargs.get("transaction")))


@pytest.fixture
def world(_module_world, db, redis_client) -> World:  # noqa: F811
    """A copy for each test, so an object one test changes in memory is not the next's."""
    return copy.deepcopy(_module_world)


# --- the browser ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    """One headless Debian Chromium per module (never a downloaded browser).

    NOTE: module, not session: while Playwright's sync API is started it marks an event
    loop as running in this thread, which would break asyncio tests that run after it.
    """
    if not Path(CHROMIUM).exists():
        missing = f"no Chromium at {CHROMIUM} (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(missing)  # CI runs what it claims: .ci/run installs Chromium
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def new_page(browser, api_server) -> Iterator:  # noqa: F811
    """Pages in a fresh context (no cookies) on the live server; closed after the test."""
    contexts = []

    def make(viewport=(1366, 860)):
        context = browser.new_context(base_url=api_server,
                                      viewport={"width": viewport[0], "height": viewport[1]})
        context.set_default_timeout(20_000)
        contexts.append(context)
        return context.new_page()

    yield make
    for context in contexts:
        context.close()


def screenshot(page, name: str) -> Path:
    """Saves the page as a test artefact (test-artifacts/screenshots/NAME.png)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def sign_in(page, email: str, password: str) -> None:
    page.goto("/console/login")
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_load_state()
