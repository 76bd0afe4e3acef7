"""The management API, walked endpoint by endpoint from the URLconf.

Every tenant-owned endpoint answers another tenant's ids with 404, every
mutating endpoint answers an under-privileged role or key with 403, and
neither changes anything. A new endpoint joins the walks by itself; a new
URL parameter or mutating operation fails them until it is described here.
"""

from __future__ import annotations

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from tenants import access
from tenants.access import Actor, TenantAccess
from tenants.models import ApiKey, AuditEvent, Invitation, Membership, QuotaOverride, Role, Tenant
from tenants.services import invitation_create
from tenants.urls import urlpatterns
from tests.factories import key_factory, member_factory, tenant_factory, user_factory

pytestmark = pytest.mark.django_db

TENANT_PREFIX = "tenants/<slug:slug>"
# Endpoints outside any tenant, and why.
NOT_TENANT_OWNED = {
    "me": "the caller itself",
    "plans": "operators' price list",
    "plan": "operators' price list",
    "tenants": "lists only what the caller may see; creating is for operators",
    "invitation-accept": "the token names the tenant; the invitee is not a member yet",
}
OBJECT_KWARGS = {"key_id", "member_id", "invitation_id"}
MUTATING = {"post", "put", "patch", "delete"}
# The action each mutating operation needs (tenants/access.py RULES).
ACTION_OF = {
    ("tenant", "patch"): "tenant.update",
    ("tenant-quota", "patch"): "quota.update",
    ("keys", "post"): "key.create",
    ("key", "patch"): "key.manage",
    ("key-revoke", "post"): "key.manage",
    ("key-rotate", "post"): "key.manage",
    ("key-quota", "patch"): "key.quota",
    ("members", "post"): "member.add",
    ("member", "patch"): "member.manage",
    ("member", "delete"): "member.manage",
    ("invitations", "post"): "member.manage",
    ("invitation", "delete"): "member.manage",
}


def _endpoints():
    """(name, route, methods) of every management API URL."""
    for pattern in urlpatterns:
        cls = pattern.callback.cls
        methods = sorted(m for m in cls.http_method_names
                         if m not in {"options", "head", "trace"} and hasattr(cls, m))
        yield pattern.name, str(pattern.pattern), methods


def _tenant_endpoints():
    return [e for e in _endpoints() if e[1].startswith(TENANT_PREFIX)]


def test_every_endpoint_is_tenant_owned_or_explained():
    for name, route, _ in _endpoints():
        assert route.startswith(TENANT_PREFIX) or name in NOT_TENANT_OWNED, (
            f"{route}: scope it to a tenant or explain it in NOT_TENANT_OWNED")


def test_every_mutating_tenant_operation_names_its_action():
    found = {(name, m) for name, _, methods in _tenant_endpoints() for m in methods
             if m in MUTATING}
    assert found == set(ACTION_OF), "describe new mutating operations in ACTION_OF"
    assert set(ACTION_OF.values()) <= set(access.RULES)


class World:
    """Two tenants, each with an owner, a developer's key, a member and an invitation."""

    def __init__(self) -> None:
        self.a = tenant_factory("alpha")
        self.b = tenant_factory("bravo")
        self.owner_a = member_factory(self.a, Role.OWNER, email="owner@alpha.test")
        self.owner_b = member_factory(self.b, Role.OWNER, email="owner@bravo.test")
        self.ids = {}
        for tenant, owner in ((self.a, self.owner_a), (self.b, self.owner_b)):
            key = key_factory(tenant, created_by=owner)
            member = member_factory(tenant, Role.VIEWER)
            invitation, _ = invitation_create(tenant=tenant, email=f"new@{tenant.slug}.test",
                                              role=Role.DEVELOPER, actor=Actor())
            self.ids[tenant.slug] = {
                "key_id": key.id,
                "member_id": Membership.objects.get(tenant=tenant, user=member).pk,
                "invitation_id": invitation.pk,
            }

    def url(self, name: str, route: str, *, slug: str, ids_of: str) -> str:
        kwargs = {"slug": slug}
        for kwarg in OBJECT_KWARGS:
            if f":{kwarg}>" in route:
                kwargs[kwarg] = self.ids[ids_of][kwarg]
        unknown = {part.split(":")[1].rstrip(">") for part in route.split("/")
                   if part.startswith("<")} - set(kwargs)
        assert not unknown, f"{route}: add {unknown} to OBJECT_KWARGS and World"
        return reverse(f"tenants:{name}", kwargs=kwargs)


def _snapshot(tenant: Tenant) -> tuple:
    """Everything a request could change in a tenant."""
    return (
        sorted(ApiKey.objects.filter(tenant=tenant).values_list(
            "id", "name", "scopes", "expires_at", "revoked_at", "replaced_by")),
        sorted(Membership.objects.filter(tenant=tenant).values_list("id", "user_id", "role")),
        sorted(Invitation.objects.filter(tenant=tenant).values_list("id", "revoked_at")),
        sorted(QuotaOverride.objects.filter(tenant=tenant).values_list(
            "id", "requests_per_minute")),
        Tenant.objects.filter(pk=tenant.pk).values_list("name", "plan_id").first(),
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


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture(params=["owner session", "admin key"])
def caller_of_a(request, world) -> APIClient:
    if request.param == "owner session":
        return _session(world.owner_a)
    return _keyed(key_factory(world.a, scopes=["admin"]).plaintext)


def _assert_error(response, status: int, code: str | None = None) -> None:
    assert response.status_code == status, (response.status_code, response.content)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code


def test_another_tenants_ids_are_404_everywhere_and_change_nothing(world, caller_of_a):
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
    assert walked >= 25
    assert _snapshot(world.b) == before


def test_an_unknown_tenant_looks_like_a_foreign_one(world, caller_of_a):
    for name, route, methods in _tenant_endpoints():
        url = world.url(name, route, slug="no-such-tenant", ids_of="alpha")
        for method in methods:
            _assert_error(_call(caller_of_a, method, url), 404, "not_found")


def _mutations():
    for name, route, methods in _tenant_endpoints():
        for method in methods:
            if method in MUTATING:
                yield name, route, method


@pytest.mark.parametrize("role", [Role.VIEWER, Role.BILLING, Role.DEVELOPER, Role.ADMIN,
                                  Role.OWNER])
def test_every_mutation_a_role_may_not_do_is_403_and_changes_nothing(world, role):
    user = user_factory()
    Membership.objects.create(tenant=world.a, user=user, role=role)
    client = _session(user)
    me = TenantAccess(tenant=world.a, actor=Actor(user_id=user.pk), role=role)
    key_owner = ApiKey.objects.get(pk=world.ids["alpha"]["key_id"]).created_by_id
    before = _snapshot(world.a)
    refused = 0
    for name, route, method in _mutations():
        if access.allowed(me, ACTION_OF[(name, method)], owner_id=key_owner):
            continue
        url = world.url(name, route, slug="alpha", ids_of="alpha")
        _assert_error(_call(client, method, url), 403, "permission_denied")
        refused += 1
    assert refused >= {Role.VIEWER: 12, Role.OWNER: 2}.get(role, 1)
    assert _snapshot(world.a) == before


def test_a_key_without_the_admin_scope_is_403_on_every_tenant_endpoint(world):
    client = _keyed(key_factory(world.a, scopes=["inference", "adapters", "usage",
                                                 "billing"]).plaintext)
    before = _snapshot(world.a)
    for name, route, methods in _tenant_endpoints():
        url = world.url(name, route, slug="alpha", ids_of="alpha")
        for method in methods:
            _assert_error(_call(client, method, url), 403, "permission_denied")
    assert _snapshot(world.a) == before


def test_operator_endpoints_refuse_tenant_people_and_keys(world):
    for client in (_session(world.owner_a), _keyed(key_factory(world.a,
                                                               scopes=["admin"]).plaintext)):
        _assert_error(client.post("/api/v1/plans", {"slug": "x", "name": "X",
                                                    "requests_per_minute": 1,
                                                    "tokens_per_minute": 1,
                                                    "max_concurrent_requests": 1},
                                  format="json"), 403)
        _assert_error(client.post("/api/v1/tenants", {"name": "Evil"}, format="json"), 403)
        _assert_error(client.patch("/api/v1/plans/default", {"requests_per_minute": 10**6},
                                   format="json"), 403)


def test_no_credentials_is_401_and_a_bad_key_is_401(world):
    _assert_error(APIClient().get("/api/v1/tenants/alpha/keys"), 401, "missing_credentials")
    for bad in ("atr_" + "x" * 36, "nope"):
        _assert_error(_keyed(bad).get("/api/v1/tenants/alpha/keys"), 401, "invalid_api_key")


def test_session_writes_need_the_csrf_token(world):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(world.owner_a)
    r = client.post("/api/v1/tenants/alpha/keys", {"name": "ci"}, format="json")
    _assert_error(r, 403, "csrf_failed")
    assert client.get("/api/v1/tenants/alpha/keys").status_code == 200


def test_developers_manage_their_own_keys_only(world):
    developer = member_factory(world.a, Role.DEVELOPER)
    client = _session(developer)
    created = client.post("/api/v1/tenants/alpha/keys", {"name": "mine"}, format="json")
    assert created.status_code == 201
    mine = created.json()["id"]
    assert client.post(f"/api/v1/tenants/alpha/keys/{mine}/revoke").status_code == 200
    theirs = world.ids["alpha"]["key_id"]
    _assert_error(client.post(f"/api/v1/tenants/alpha/keys/{theirs}/revoke"), 403)
    assert ApiKey.objects.get(pk=theirs).revoked_at is None


@pytest.mark.parametrize("scopes, wanted", [
    (["admin"], ["admin", "billing"]),
    (["admin", "inference"], ["usage"]),
])
def test_a_key_cannot_grant_scopes_it_does_not_have(world, scopes, wanted):
    client = _keyed(key_factory(world.a, scopes=scopes).plaintext)
    count = ApiKey.objects.count()
    r = client.post("/api/v1/tenants/alpha/keys", {"name": "x", "scopes": wanted},
                    format="json")
    _assert_error(r, 403, "scope_escalation")
    assert ApiKey.objects.count() == count


def test_rotating_a_key_with_scopes_one_lacks_is_refused_and_changes_nothing(world):
    wide = key_factory(world.a, scopes=("inference", "billing", "usage"))
    client = _keyed(key_factory(world.a, scopes=("admin",)).plaintext)
    count = ApiKey.objects.count()
    r = client.post(f"/api/v1/tenants/alpha/keys/{wide.id}/rotate", {}, format="json")
    _assert_error(r, 403, "scope_escalation")
    assert ApiKey.objects.count() == count
    assert ApiKey.objects.get(pk=wide.id).replaced_by_id is None
    # Holding the scopes, the same rotation goes through.
    admin_and_more = _keyed(key_factory(world.a, scopes=(
        "admin", "inference", "billing", "usage")).plaintext)
    r = admin_and_more.post(f"/api/v1/tenants/alpha/keys/{wide.id}/rotate", {}, format="json")
    assert r.status_code == 201 and sorted(r.json()["new"]["scopes"]) == [
        "billing", "inference", "usage"]


def test_developers_cannot_create_admin_or_billing_keys(world):
    client = _session(member_factory(world.a, Role.DEVELOPER))
    for scopes in (["admin"], ["inference", "billing"]):
        r = client.post("/api/v1/tenants/alpha/keys", {"name": "x", "scopes": scopes},
                        format="json")
        _assert_error(r, 403, "scope_escalation")


def test_admins_cannot_make_or_unmake_owners(world):
    client = _session(member_factory(world.a, Role.ADMIN))
    member_id = world.ids["alpha"]["member_id"]
    r = client.patch(f"/api/v1/tenants/alpha/members/{member_id}", {"role": "owner"},
                     format="json")
    _assert_error(r, 403, "role_escalation")
    owner_membership = Membership.objects.get(tenant=world.a, user=world.owner_a).pk
    _assert_error(client.delete(f"/api/v1/tenants/alpha/members/{owner_membership}"), 403)
    r = client.post("/api/v1/tenants/alpha/invitations", {"email": "x@y.test", "role": "owner"},
                    format="json")
    _assert_error(r, 403, "role_escalation")
    assert client.patch(f"/api/v1/tenants/alpha/members/{member_id}", {"role": "developer"},
                        format="json").status_code == 200


def test_the_last_owner_cannot_leave_or_be_demoted(world):
    client = _session(world.owner_a)
    own = Membership.objects.get(tenant=world.a, user=world.owner_a).pk
    _assert_error(client.patch(f"/api/v1/tenants/alpha/members/{own}", {"role": "admin"},
                               format="json"), 409, "conflict")
    _assert_error(client.delete(f"/api/v1/tenants/alpha/members/{own}"), 409, "conflict")


def test_a_new_key_is_shown_once(world):
    client = _session(world.owner_a)
    r = client.post("/api/v1/tenants/alpha/keys",
                    {"name": "ci", "scopes": ["inference", "usage"]}, format="json")
    assert r.status_code == 201
    body = r.json()
    assert body["key"].startswith(body["prefix"]) and body["scopes"] == ["inference", "usage"]
    listed = client.get("/api/v1/tenants/alpha/keys").json()["data"]
    detail = client.get(f"/api/v1/tenants/alpha/keys/{body['id']}").json()
    assert all("key" not in k for k in listed) and "key" not in detail
    assert body["key"] not in str(listed) + str(detail)


def test_bad_input_is_400_in_the_openai_shape_and_changes_nothing(world):
    client = _session(world.owner_a)
    before = _snapshot(world.a)
    for body, param, code in [
        ({"scopes": ["inference"]}, "name", "missing_required_parameter"),
        ({"name": "x", "scopes": ["root"]}, "scopes", "invalid_value"),
        ({"name": "x", "scopes": []}, "scopes", "invalid_value"),
        ({"name": "x", "colour": "red"}, "colour", "unknown_parameter"),
        ({"name": "x", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at", "invalid_value"),
    ]:
        r = client.post("/api/v1/tenants/alpha/keys", body, format="json")
        _assert_error(r, 400, code)
        assert r.json()["error"]["param"] == param
    r = client.post("/api/v1/tenants/alpha/keys", b"{not json", content_type="application/json")
    _assert_error(r, 400, "invalid_json")
    assert _snapshot(world.a) == before


def test_changes_are_audited_with_before_and_after_for_admins_only(world):
    client = _session(world.owner_a)
    key = client.post("/api/v1/tenants/alpha/keys", {"name": "ci"}, format="json").json()
    client.patch(f"/api/v1/tenants/alpha/keys/{key['id']}", {"scopes": ["inference", "usage"]},
                 format="json")
    client.patch(f"/api/v1/tenants/alpha/keys/{key['id']}/quota", {"requests_per_minute": 5},
                 format="json")
    client.post(f"/api/v1/tenants/alpha/keys/{key['id']}/revoke")
    member_id = world.ids["alpha"]["member_id"]
    client.patch(f"/api/v1/tenants/alpha/members/{member_id}", {"role": "billing"},
                 format="json")
    events = client.get("/api/v1/tenants/alpha/audit-events").json()["data"]
    by_action = {e["action"]: e for e in events}
    assert {"api_key.create", "api_key.update", "api_key.quota.update", "api_key.revoke",
            "member.update"} <= set(by_action)
    update = by_action["api_key.update"]
    assert update["actor"] == "user:owner@alpha.test"
    assert update["before"]["scopes"] == ["inference"]
    assert update["after"]["scopes"] == ["inference", "usage"]
    assert by_action["api_key.quota.update"]["after"]["requests_per_minute"] == 5
    assert by_action["member.update"]["before"]["role"] == "viewer"
    assert by_action["member.update"]["after"]["role"] == "billing"
    assert key["key"] not in str(events)
    assert all(e["action"] != "api_key.create" or e["target_id"] for e in events)
    developer = _session(member_factory(world.a, Role.DEVELOPER))
    _assert_error(developer.get("/api/v1/tenants/alpha/audit-events"), 403)


def test_audit_log_pages_newest_first(world):
    client = _session(world.owner_a)
    first = client.get("/api/v1/tenants/alpha/audit-events?limit=2").json()
    assert len(first["data"]) == 2 and first["has_more"]
    ids = [e["id"] for e in first["data"]]
    assert ids == sorted(ids, reverse=True)
    rest = client.get(f"/api/v1/tenants/alpha/audit-events?limit=200&before={ids[-1]}").json()
    assert all(e["id"] < ids[-1] for e in rest["data"]) and not rest["has_more"]


def test_operators_create_tenants_set_plans_and_override_quotas(world):
    staff = user_factory(is_staff=True)
    owner = user_factory(email="boss@charlie.test")
    client = _session(staff)
    r = client.post("/api/v1/plans", {"slug": "pro", "name": "Pro", "priority": 1,
                                      "requests_per_minute": 100, "tokens_per_minute": 5000,
                                      "max_concurrent_requests": 4}, format="json")
    assert r.status_code == 201
    r = client.post("/api/v1/tenants", {"name": "Charlie", "plan": "pro",
                                        "owner_email": "boss@charlie.test"}, format="json")
    assert r.status_code == 201 and r.json()["plan"] == "pro" and r.json()["priority"] == 1
    assert Membership.objects.get(tenant__slug="charlie", user=owner).role == Role.OWNER
    r = client.patch("/api/v1/tenants/charlie/quota", {"tokens_per_minute": 9000,
                                                       "monthly_token_cap": 10**6},
                     format="json")
    assert r.status_code == 200
    quota = r.json()
    assert quota["effective"]["tokens_per_minute"] == 9000
    assert quota["effective"]["requests_per_minute"] == 100
    assert quota["plan_limits"]["tokens_per_minute"] == 5000
    owner_view = _session(owner).get("/api/v1/tenants/charlie/quota").json()
    assert owner_view == quota
    _assert_error(_session(owner).patch("/api/v1/tenants/charlie/quota",
                                        {"tokens_per_minute": 10**9}, format="json"), 403)
    _assert_error(_session(owner).patch("/api/v1/tenants/charlie", {"plan": "default"},
                                        format="json"), 403)
    assert _session(owner).patch("/api/v1/tenants/charlie", {"name": "Charlie Ltd"},
                                 format="json").json()["name"] == "Charlie Ltd"


def test_operators_set_what_a_plans_tenants_may_keep(world):
    from django.conf import settings

    from batches.services.limits import tenant_limit
    from tenants.models import Plan, Tenant

    client = _session(user_factory(is_staff=True))
    r = client.post("/api/v1/plans", {"slug": "lean", "name": "Lean", "priority": 5,
                                      "requests_per_minute": 10, "tokens_per_minute": 500,
                                      "max_concurrent_requests": 2, "max_files": 3,
                                      "max_active_batches": 1}, format="json")
    assert r.status_code == 201, r.content
    assert (r.json()["max_files"], r.json()["max_file_bytes"]) == (3, None)
    r = client.patch("/api/v1/plans/lean", {"max_file_bytes": 10**6, "max_files": None},
                     format="json")
    assert (r.json()["max_files"], r.json()["max_file_bytes"]) == (None, 10**6)
    _assert_error(client.patch("/api/v1/plans/lean", {"max_active_batches": 0},
                               format="json"), 400)
    Tenant.objects.filter(pk=world.a.pk).update(plan=Plan.objects.get(slug="lean"))
    assert [tenant_limit(tenant_id=world.a.pk, name=n) for n in
            ("max_files", "max_file_bytes", "max_active_batches")] == [
        settings.ATRIUM_TENANT_MAX_FILES, 10**6, 1]


def test_limits_past_what_the_columns_hold_and_nested_json_are_400s(world):
    from tenants.models import Plan

    client = _session(user_factory(is_staff=True))
    for body in ({"requests_per_minute": 10**30}, {"monthly_token_cap": 2**63},
                 {"tokens_per_minute": 2**31}):
        _assert_error(client.patch("/api/v1/tenants/alpha/quota", body, format="json"), 400)
    assert not QuotaOverride.objects.filter(tenant=world.a).exists()
    _assert_error(client.post("/api/v1/plans", {
        "slug": "huge", "name": "Huge", "priority": 1, "requests_per_minute": 2**40,
        "tokens_per_minute": 1, "max_concurrent_requests": 1}, format="json"), 400)
    assert not Plan.objects.filter(slug="huge").exists()
    r = client.generic("PATCH", "/api/v1/tenants/alpha/quota", "[" * 100_000 + "]" * 100_000,
                       content_type="application/json")
    _assert_error(r, 400)
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_invitations_are_accepted_once_by_their_addressee(world):
    owner = _session(world.owner_a)
    r = owner.post("/api/v1/tenants/alpha/invitations",
                   {"email": "Dev@Alpha.test", "role": "developer"}, format="json")
    assert r.status_code == 201
    token = r.json()["token"]
    assert token not in str(Invitation.objects.values())
    stranger = _session(user_factory(email="someone@else.test"))
    _assert_error(stranger.post("/api/v1/invitations/accept", {"token": token},
                                format="json"), 403)
    invitee = user_factory(email="dev@alpha.test")
    accepted = _session(invitee).post("/api/v1/invitations/accept", {"token": token},
                                      format="json")
    assert accepted.status_code == 201 and accepted.json()["member"]["role"] == "developer"
    _assert_error(_session(invitee).post("/api/v1/invitations/accept", {"token": token},
                                         format="json"), 404, "invitation_not_found")
    _assert_error(stranger.post("/api/v1/invitations/accept", {"token": "atrinv_nope"},
                                format="json"), 404, "invitation_not_found")
    assert _session(invitee).get("/api/v1/tenants/alpha").status_code == 200


def test_me_describes_the_caller(world):
    me = _session(world.owner_a).get("/api/v1/me").json()
    assert me["memberships"] == [{"tenant": "alpha", "role": "owner"}]
    key = key_factory(world.a, scopes=["admin"])
    assert _keyed(key.plaintext).get("/api/v1/me").json()["prefix"] == key.prefix


def test_openapi_schema_and_docs_are_published(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    spec = schema.json()
    operations = {op["operationId"] for path in spec["paths"].values() for op in path.values()
                  if isinstance(op, dict) and "operationId" in op}
    assert {"api_key_create", "api_key_revoke", "api_key_rotate", "member_update",
            "tenant_quota_update", "audit_event_list", "invitation_accept"} <= operations
    assert client.get("/api/docs/").status_code == 200
