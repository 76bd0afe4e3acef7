"""Every console URL walked with every role, from its URLconf: another tenant's tenant or
objects are 404, a role the matrix (tenants/access.py) refuses is 403 and changes nothing,
anonymous people are sent to sign in, the operator console is for staff only, and every
form needs its CSRF token. A new view joins these walks by itself, and fails them until
it is described here."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from tenants import access
from tenants.access import Actor, TenantAccess
from tenants.models import AuditEvent, Role
from webui.urls import urlpatterns

pytestmark = pytest.mark.django_db

# (url name, method) -> the action the matrix must allow.
TENANT_OPERATIONS = {
    ("overview", "get"): "usage.read",
    ("keys", "get"): "key.read",
    ("keys", "post"): "key.create",
    ("key-revoke", "post"): "key.manage",
    ("key-rotate", "post"): "key.manage",
    ("usage", "get"): "usage.read",
    ("billing", "get"): "billing.read",
    ("invoice", "get"): "billing.read",
    ("export-create", "post"): "billing.export",
    ("export-download", "get"): "billing.read",
    ("budgets", "get"): "budget.read",
    ("budget-create", "post"): "budget.manage",
    ("budget-delete", "post"): "budget.manage",
    ("webhook-create", "post"): "webhook.manage",
    ("webhook-delete", "post"): "webhook.manage",
    ("batches", "get"): "batch.read",
    ("file-download", "get"): "batch.read",
    ("adapters", "get"): "adapter.read",
    ("adapters", "post"): "adapter.create",
    ("adapter-delete", "post"): "adapter.delete",
    ("logs", "get"): "log.read",
    ("log-policy", "post"): "log.manage",
    ("log", "get"): "log.read",
    ("quotas", "get"): "quota.read",
    ("members", "get"): "member.read",
    ("member-invite", "post"): "member.manage",
    ("member-role", "post"): "member.manage",
    ("member-remove", "post"): "member.manage",
    ("invitation-revoke", "post"): "member.manage",
    ("audit", "get"): "audit.read",
}
OPERATOR = {"op-tenants", "op-tenant", "op-tenant-plan", "op-tenant-quota",
            "op-tenant-spend-cap", "op-tenant-member", "op-plans", "op-plan",
            "op-plan-spend-cap", "op-prices", "op-adapters", "op-adapter-visibility", "op-fleet",
            "op-health"}
SIGNED_IN = {"home", "invitation-accept"}
PUBLIC = {"login", "logout"}
# Each URL's object, by the World's object kinds.
OBJECT_OF = {"key-revoke": "key_id", "key-rotate": "key_id", "invoice": "invoice_id",
             "export-download": "export_id", "adapter-delete": "adapter_id",
             "log": "request_id", "member-role": "member_id", "member-remove": "member_id",
             "invitation-revoke": "invitation_id", "budget-delete": "budget_id",
             "webhook-delete": "endpoint_id", "file-download": "file_id"}
# What a permitted POST sends (a valid form, so the service really runs).
FORMS = {
    "keys": {"name": "k", "scopes": ["inference"]},
    "key-rotate": {"grace_hours": "1"},
    "export-create": {"kind": "ledger", "format": "csv", "start": "2026-01-01",
                      "end": "2026-01-31"},
    "log-policy": {"retention_days": "10"},
    "member-invite": {"email": "x@acme.test", "role": "viewer"},
    "member-role": {"role": "admin"},
    "budget-create": {"scope": "key", "window": "day", "token_limit": "1000"},
    "webhook-create": {"url": "https://hooks.acme.test/atrium"},
}


def _tenant_routes():
    for p in urlpatterns:
        if str(p.pattern).startswith("t/<slug:slug>"):
            yield p.name, p.callback


def _kwargs(world, name: str, objects: dict) -> dict:
    kwargs = {"slug": world.acme.slug}
    if name in OBJECT_OF:
        kind = OBJECT_OF[name]
        kwargs[kind] = objects[kind]
    return kwargs


def _url(world, name: str, objects: dict | None = None) -> str:
    return reverse(f"webui:{name}", kwargs=_kwargs(world, name, objects or world.objects))


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _call(client: Client, method: str, url: str, name: str):
    if method == "post":
        return client.post(url, FORMS.get(name, {}))
    return client.get(url)


def test_every_console_url_is_described():
    names = {p.name for p in urlpatterns}
    described = {n for n, _ in TENANT_OPERATIONS} | OPERATOR | SIGNED_IN | PUBLIC
    assert names == described


def test_every_tenant_view_declares_the_methods_it_answers():
    declared = {}
    for name, view in _tenant_routes():
        declared.update({(name, m.lower()): view for m in view.console_methods})
    assert set(declared) == set(TENANT_OPERATIONS)
    assert set(TENANT_OPERATIONS.values()) <= set(access.RULES)


OPERATIONS = sorted(TENANT_OPERATIONS)


@pytest.mark.parametrize("role", [r.value for r in Role])
@pytest.mark.parametrize(("name", "method"), OPERATIONS)
def test_each_role_gets_exactly_what_the_matrix_allows(world, name, method, role):
    user = world.people[role]
    owner_id = world.people["owner"].pk if OBJECT_OF.get(name) == "key_id" else None
    allowed = access.allowed(TenantAccess(tenant=world.acme, actor=Actor(
        user_id=user.pk, user_email=user.email), role=role), TENANT_OPERATIONS[name, method],
        owner_id=owner_id)
    events = AuditEvent.objects.count()
    response = _call(_client(user), method, _url(world, name), name)
    if allowed:
        assert response.status_code in (200, 302, 400), response.status_code
    else:
        assert response.status_code == 403
        assert AuditEvent.objects.count() == events


@pytest.mark.parametrize(("name", "method"), OPERATIONS)
def test_another_tenants_member_gets_404(world, name, method):
    events = AuditEvent.objects.count()
    response = _call(_client(world.outsider), method, _url(world, name), name)
    assert response.status_code == 404
    assert AuditEvent.objects.count() == events


@pytest.mark.parametrize("name", sorted(OBJECT_OF))
def test_another_tenants_object_is_404_even_to_an_owner(world, name):
    method = next(m for n, m in OPERATIONS if n == name)
    events = AuditEvent.objects.count()
    response = _call(_client(world.people["owner"]), method,
                     _url(world, name, world.other_objects), name)
    assert response.status_code == 404
    assert AuditEvent.objects.count() == events


def test_a_developer_manages_only_keys_they_created(world):
    from tenants.services import api_key_create

    developer = world.people["developer"]
    own, _ = api_key_create(tenant=world.acme, name="mine", created_by=developer)
    client = _client(developer)
    slug = world.acme.slug
    assert client.post(reverse("webui:key-revoke", kwargs={
        "slug": slug, "key_id": world.objects["key_id"]})).status_code == 403
    assert client.post(reverse("webui:key-revoke", kwargs={
        "slug": slug, "key_id": own.pk})).status_code == 302
    own.refresh_from_db()
    assert own.revoked_at is not None


def test_a_developer_cannot_grant_scopes_beyond_their_role(world):
    response = _client(world.people["developer"]).post(
        reverse("webui:keys", kwargs={"slug": world.acme.slug}),
        {"name": "sneaky", "scopes": ["admin"]})
    assert response.status_code in (400, 403)
    assert not world.acme.api_keys.filter(name="sneaky").exists()


def test_an_admin_cannot_touch_an_owner(world):
    owner_member = world.acme.memberships.get(user=world.people["owner"]).pk
    client = _client(world.people["admin"])
    url = reverse("webui:member-role", kwargs={"slug": world.acme.slug,
                                                "member_id": owner_member})
    assert client.post(url, {"role": "viewer"}).status_code == 403
    assert world.acme.memberships.get(pk=owner_member).role == "owner"


@pytest.mark.parametrize(("name", "method"), OPERATIONS)
def test_anonymous_people_are_sent_to_sign_in(world, name, method):
    response = _call(Client(), method, _url(world, name), name)
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("webui:login"))


def _operator_urls(world):
    kwargs = {"op-tenant": {"slug": "acme"}, "op-tenant-plan": {"slug": "acme"},
              "op-tenant-quota": {"slug": "acme"}, "op-tenant-spend-cap": {"slug": "acme"},
              "op-tenant-member": {"slug": "acme"}, "op-plan": {"plan_slug": "default"},
              "op-plan-spend-cap": {"plan_slug": "default"},
              "op-adapter-visibility": {"slug": "acme",
                                        "adapter_id": world.objects["adapter_id"]}}
    for p in urlpatterns:
        if p.name in OPERATOR:
            view = p.callback
            for method in view.console_methods:
                yield p.name, method.lower(), reverse(f"webui:{p.name}",
                                                      kwargs=kwargs.get(p.name, {}))


def test_the_operator_console_is_for_staff_only(world):
    owner = _client(world.people["owner"])
    staff = _client(world.staff)
    events = AuditEvent.objects.count()
    for name, method, url in _operator_urls(world):
        assert _call(owner, method, url, name).status_code == 403, url
    assert AuditEvent.objects.count() == events
    for _name, method, url in _operator_urls(world):
        if method == "get":
            assert staff.get(url).status_code == 200, url


def test_forms_without_a_csrf_token_are_refused(world):
    client = Client(enforce_csrf_checks=True)
    client.force_login(world.people["owner"])
    response = client.post(reverse("webui:keys", kwargs={"slug": "acme"}),
                           {"name": "k", "scopes": ["inference"]})
    assert response.status_code == 403
    assert not world.acme.api_keys.filter(name="k").exists()


def test_console_pages_carry_a_content_security_policy(world):
    response = _client(world.people["owner"]).get(reverse("webui:overview",
                                                          kwargs={"slug": "acme"}))
    policy = response["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
