"""The request-log API, walked endpoint by endpoint: tenant isolation, roles and scopes,
filters, and bad input that changes nothing."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from requestlogs.models import LogPolicy, RedactionPattern, RequestLog
from requestlogs.services import RequestLogEntry, redaction_pattern_create, request_log_record
from requestlogs.urls import urlpatterns
from tenants.access import SYSTEM
from tenants.models import AuditEvent, Membership, Role
from tests.factories import key_factory, member_factory, tenant_factory, user_factory

pytestmark = pytest.mark.django_db

TENANT_PREFIX = "tenants/<slug:slug>"
NOT_TENANT_OWNED = {"operator-request-logs": "the operator's view across tenants"}
OBJECT_KWARGS = {"request_id", "pattern_id"}
MUTATING = {"post", "put", "patch", "delete"}
READ_ROLES = {Role.OWNER, Role.ADMIN, Role.DEVELOPER}
MANAGE_ROLES = {Role.OWNER, Role.ADMIN}


def _log(tenant, **overrides) -> RequestLog:
    values = dict(request_id=f"chatcmpl-{uuid.uuid4().hex}", tenant_id=tenant.pk, endpoint="chat",
                  transport="http", model="tiny-llama", status=200, finish_reason="stop",
                  prompt_tokens=5, completion_tokens=7)
    values.update(overrides)
    assert request_log_record(entry=RequestLogEntry(**values))
    return RequestLog.objects.get(request_id=values["request_id"])


class World:
    def __init__(self) -> None:
        self.a = tenant_factory("alpha")
        self.b = tenant_factory("bravo")
        self.owner_a = member_factory(self.a, Role.OWNER, email="owner@alpha.test")
        self.owner_b = member_factory(self.b, Role.OWNER, email="owner@bravo.test")
        self.ids = {}
        for tenant in (self.a, self.b):
            log = _log(tenant)
            pattern = redaction_pattern_create(tenant=tenant, actor=SYSTEM, name="EMPLOYEE",
                                               pattern=r"EMP-\d{6}")
            self.ids[tenant.slug] = {"request_id": log.request_id, "pattern_id": pattern.pk}

    def url(self, name: str, route: str, *, slug: str, ids_of: str) -> str:
        kwargs = {"slug": slug}
        for kwarg in OBJECT_KWARGS:
            if f":{kwarg}>" in route:
                kwargs[kwarg] = self.ids[ids_of][kwarg]
        return reverse(f"requestlogs:{name}", kwargs=kwargs)


def _endpoints():
    for pattern in urlpatterns:
        cls = pattern.callback.cls
        methods = sorted(m for m in cls.http_method_names
                         if m not in {"options", "head", "trace"} and hasattr(cls, m))
        yield pattern.name, str(pattern.pattern), methods


def _tenant_endpoints():
    return [e for e in _endpoints() if e[1].startswith(TENANT_PREFIX)]


def _snapshot(tenant) -> tuple:
    return (
        sorted(RequestLog.objects.filter(tenant=tenant).values_list("id", "status")),
        sorted(RedactionPattern.objects.filter(tenant=tenant).values_list("id", "pattern")),
        list(LogPolicy.objects.filter(tenant=tenant).values_list("log_bodies",
                                                                 "retention_days")),
        AuditEvent.objects.filter(tenant=tenant).count(),
    )


def _call(client: APIClient, method: str, url: str):
    return getattr(client, method)(url, {}, format="json")


def _session(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def _keyed(plaintext: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


def _assert_error(response, status: int, code: str | None = None) -> None:
    assert response.status_code == status, (response.status_code, response.content)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture(params=["owner session", "admin key"])
def caller_of_a(request, world) -> APIClient:
    if request.param == "owner session":
        return _session(world.owner_a)
    return _keyed(key_factory(world.a, scopes=["admin"]).plaintext)


def test_every_endpoint_is_tenant_owned_or_explained():
    for name, route, _ in _endpoints():
        assert route.startswith(TENANT_PREFIX) or name in NOT_TENANT_OWNED, route


def test_another_tenants_logs_and_patterns_are_404_and_change_nothing(world, caller_of_a):
    before = _snapshot(world.b)
    walked = 0
    for name, route, methods in _tenant_endpoints():
        urls = [world.url(name, route, slug="bravo", ids_of="bravo")]
        if any(f":{k}>" in route for k in OBJECT_KWARGS):
            urls.append(world.url(name, route, slug="alpha", ids_of="bravo"))
        for url in urls:
            for method in methods:
                _assert_error(_call(caller_of_a, method, url), 404, "not_found")
                walked += 1
    assert walked >= 9
    assert _snapshot(world.b) == before


def test_an_unknown_tenant_looks_like_a_foreign_one(world, caller_of_a):
    for name, route, methods in _tenant_endpoints():
        url = world.url(name, route, slug="no-such-tenant", ids_of="alpha")
        for method in methods:
            _assert_error(_call(caller_of_a, method, url), 404, "not_found")


@pytest.mark.parametrize("role", list(Role))
def test_each_role_reads_and_manages_only_what_it_may(world, role):
    user = user_factory()
    Membership.objects.create(tenant=world.a, user=user, role=role)
    client = _session(user)
    before = _snapshot(world.a)
    for name, route, methods in _tenant_endpoints():
        url = world.url(name, route, slug="alpha", ids_of="alpha")
        for method in methods:
            allowed = role in (MANAGE_ROLES if method in MUTATING else READ_ROLES)
            if allowed and method == "get":
                assert _call(client, method, url).status_code == 200
            elif not allowed:
                _assert_error(_call(client, method, url), 403, "permission_denied")
    assert _snapshot(world.a) == before


def test_a_key_without_the_admin_scope_is_403_everywhere(world):
    client = _keyed(key_factory(world.a, scopes=["inference", "adapters", "usage",
                                                 "billing"]).plaintext)
    before = _snapshot(world.a)
    for name, route, methods in _tenant_endpoints():
        url = world.url(name, route, slug="alpha", ids_of="alpha")
        for method in methods:
            _assert_error(_call(client, method, url), 403, "permission_denied")
    assert _snapshot(world.a) == before


def test_operators_see_every_tenant_and_nobody_else_does(world):
    staff = _session(user_factory(is_staff=True))
    everything = staff.get("/api/v1/request-logs").json()["data"]
    assert {e["tenant"] for e in everything} == {"alpha", "bravo"}
    only_b = staff.get("/api/v1/request-logs?tenant=bravo").json()["data"]
    assert [e["request_id"] for e in only_b] == [world.ids["bravo"]["request_id"]]
    _assert_error(staff.get("/api/v1/request-logs?tenant=nope"), 404)
    for client in (_session(world.owner_a),
                   _keyed(key_factory(world.a, scopes=["admin"]).plaintext)):
        _assert_error(client.get("/api/v1/request-logs"), 403, "permission_denied")
    # Operators read a tenant's logs but do not decide what a tenant keeps.
    assert staff.get("/api/v1/tenants/alpha/request-logs").status_code == 200
    _assert_error(staff.patch("/api/v1/tenants/alpha/log-settings", {"log_bodies": True},
                              format="json"), 403)


def test_logs_filter_by_time_model_adapter_key_and_status(world):
    now = datetime.now(UTC)
    key = key_factory(world.a)
    old = _log(world.a, created_at=(now - timedelta(days=3)).timestamp())
    adapted = _log(world.a, adapter="alpha/support@1", api_key_id=key.id,
                   api_key_prefix=key.prefix)
    failed = _log(world.a, model="other-model", status=503, error_code="engine_unavailable")
    client = _session(world.owner_a)

    def ids(query: str) -> set[int]:
        r = client.get(f"/api/v1/tenants/alpha/request-logs?{query}")
        assert r.status_code == 200, r.content
        return {e["id"] for e in r.json()["data"]}

    since = (now - timedelta(days=1)).isoformat().replace("+00:00", "Z")
    assert old.id not in ids(f"since={since}") and adapted.id in ids(f"since={since}")
    assert ids(f"until={since}") == {old.id}
    assert ids("model=other-model") == {failed.id}
    assert ids("adapter=alpha/support@1") == {adapted.id}
    assert ids(f"key={key.id}") == {adapted.id}
    assert ids("status=503") == {failed.id}
    first = client.get("/api/v1/tenants/alpha/request-logs?limit=2").json()
    assert len(first["data"]) == 2 and first["has_more"]
    rest = ids(f"before={first['data'][-1]['id']}")
    assert rest and all(i < first["data"][-1]["id"] for i in rest)


def test_one_log_is_found_by_the_id_the_client_saw(world):
    client = _session(world.owner_a)
    rid = world.ids["alpha"]["request_id"]
    for shown in (rid, rid.removeprefix("chatcmpl-")):
        body = client.get(f"/api/v1/tenants/alpha/request-logs/{shown}").json()
        assert body["request_id"] == rid
        assert body["prompt"] is None and body["completion"] is None
    assert client.get(f"/api/v1/tenants/alpha/request-logs/cmpl-{rid[9:]}").status_code == 404


def test_a_log_stored_under_the_hex_part_alone_shows_and_finds_the_clients_id(world):
    # As a web process older than migration 0002 writes it during a rolling deploy.
    legacy = _log(world.a, request_id="0a1b2c3d", endpoint="completion")
    client = _session(world.owner_a)
    for shown in ("cmpl-0a1b2c3d", "0a1b2c3d"):
        body = client.get(f"/api/v1/tenants/alpha/request-logs/{shown}").json()
        assert (body["id"], body["request_id"]) == (legacy.id, "cmpl-0a1b2c3d")


def test_migration_0002_gives_older_logs_the_id_their_client_got(world):
    import importlib

    from django.apps import apps

    migration = importlib.import_module(
        "requestlogs.migrations.0002_request_ids_as_the_client_saw_them")
    chat = _log(world.a, request_id="11aa", endpoint="chat")
    completion = _log(world.a, request_id="22bb", endpoint="completion")
    current = world.ids["alpha"]["request_id"]
    migration.prefix_request_ids(apps, None)
    migration.prefix_request_ids(apps, None)  # a second run changes nothing
    assert RequestLog.objects.get(pk=chat.pk).request_id == "chatcmpl-11aa"
    assert RequestLog.objects.get(pk=completion.pk).request_id == "cmpl-22bb"
    assert RequestLog.objects.filter(request_id=current).count() == 1


def test_bad_filters_are_400_in_the_openai_shape(world):
    client = _session(world.owner_a)
    for query, param, code in [("colour=red", "colour", "unknown_parameter"),
                               ("limit=0", "limit", "invalid_value"),
                               ("status=abc", "status", "invalid_value"),
                               ("since=yesterday", "since", "invalid_value"),
                               ("since=2024-02-01T00:00:00Z&until=2024-01-01T00:00:00Z",
                                "since", "invalid_value")]:
        r = client.get(f"/api/v1/tenants/alpha/request-logs?{query}")
        _assert_error(r, 400, code)
        assert r.json()["error"]["param"] == param


def test_log_settings_change_and_are_audited(world):
    client = _session(world.owner_a)
    assert client.get("/api/v1/tenants/alpha/log-settings").json() == {
        "object": "log_settings", "log_bodies": False, "retention_days": 30}
    r = client.patch("/api/v1/tenants/alpha/log-settings",
                     {"log_bodies": True, "retention_days": 7}, format="json")
    assert r.json() == {"object": "log_settings", "log_bodies": True, "retention_days": 7}
    event = AuditEvent.objects.filter(tenant=world.a, action="log_policy.update").get()
    assert event.before == {"log_bodies": False, "retention_days": 30}
    assert event.after == {"log_bodies": True, "retention_days": 7}


def test_bad_settings_are_400_and_change_nothing(world):
    client = _session(world.owner_a)
    before = _snapshot(world.a)
    for body, param in [({"retention_days": 0}, "retention_days"),
                        ({"retention_days": 10_000}, "retention_days"),
                        ({"log_bodies": "maybe"}, "log_bodies"),
                        ({"keep": True}, "keep")]:
        r = client.patch("/api/v1/tenants/alpha/log-settings", body, format="json")
        _assert_error(r, 400)
        assert r.json()["error"]["param"] == param
    assert _snapshot(world.a) == before


@pytest.mark.parametrize("pattern, reason", [
    (r"(?:a+)+b", "unlimited repetition"),
    (r"(?:ab{1,5}){1,5}c", "only single characters"),
    (r"(\w+)\s\1", "backreferences"),
    (r"secret(?=\d)", "lookahead"),
    (r"x.*y", "unlimited repetition"),
    (r"ID-[0-9]{0,10}[0-9]", "can also match what follows"),
    (r"[a-z]{4,}", "too broad"),
    (r"\d{4}", "too broad"),
    (r"ab", "fewer than 4"),
    (r"[unclosed", "does not compile"),
])
def test_unsafe_or_broad_patterns_are_refused_on_save(world, pattern, reason):
    client = _session(world.owner_a)
    before = _snapshot(world.a)
    r = client.post("/api/v1/tenants/alpha/redaction-patterns",
                    {"name": "MINE", "pattern": pattern}, format="json")
    _assert_error(r, 400, "invalid_pattern")
    assert reason in r.json()["error"]["message"] and r.json()["error"]["param"] == "pattern"
    assert _snapshot(world.a) == before


def test_a_long_pattern_and_a_bad_name_are_refused(world):
    client = _session(world.owner_a)
    before = _snapshot(world.a)
    for body, param in [({"name": "LONG", "pattern": "ACME-" + "x" * 300}, "pattern"),
                        ({"name": "lower", "pattern": r"ACME-\d{6}"}, "name"),
                        ({"name": "EMPLOYEE", "pattern": r"ACME-\d{6}"}, "name")]:
        r = client.post("/api/v1/tenants/alpha/redaction-patterns", body, format="json")
        assert r.status_code in (400, 409) and r.json()["error"]["param"] == param
    assert _snapshot(world.a) == before


def test_patterns_are_created_listed_and_deleted(world):
    client = _session(world.owner_a)
    r = client.post("/api/v1/tenants/alpha/redaction-patterns",
                    {"name": "TICKET", "pattern": r"(?i)tkt-[0-9a-f]{8}"}, format="json")
    assert r.status_code == 201
    created = r.json()
    names = [p["name"] for p in client.get(
        "/api/v1/tenants/alpha/redaction-patterns").json()["data"]]
    assert names == ["EMPLOYEE", "TICKET"]
    url = f"/api/v1/tenants/alpha/redaction-patterns/{created['id']}"
    assert client.delete(url).status_code == 204
    _assert_error(client.delete(url), 404)
    actions = set(AuditEvent.objects.filter(tenant=world.a).values_list("action", flat=True))
    assert {"redaction_pattern.create", "redaction_pattern.delete"} <= actions


def test_openapi_schema_lists_the_log_operations(client):
    spec = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    operations = {op["operationId"] for path in spec["paths"].values() for op in path.values()
                  if isinstance(op, dict) and "operationId" in op}
    assert {"request_log_list", "request_log_detail", "operator_request_log_list",
            "log_settings_update", "redaction_pattern_create"} <= operations
