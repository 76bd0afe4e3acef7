"""API keys from creation to revocation, through the Redis key cache the hot path reads."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from django.utils import timezone

from core import redis as core_redis
from core.errors import Conflict, InvalidRequest, ServiceUnavailable
from tenants import key_cache, keys
from tenants.access import SYSTEM
from tenants.models import ApiKey, AuditEvent, Tenant
from tenants.principals import Principal
from tenants.selectors import principal_from_api_key
from tenants.services import (
    api_key_create,
    api_key_quota_update,
    api_key_revoke,
    api_key_rotate,
    api_key_update,
    tenant_quota_update,
    tenant_update,
)
from tests.factories import key_factory, plan_factory, tenant_factory

# NOTE: transactional: a cache miss reads the database from another thread, which must see
# what the test wrote.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_cache(settings):
    from core.redis import sync_client

    sync_client().flushdb()
    yield
    core_redis._async_clients.clear()


def lookup(plaintext: str) -> Principal | str:
    from asgiref.sync import sync_to_async
    from django.db import connections

    async def run():
        try:
            return await key_cache.principal_lookup(plaintext=plaintext)
        finally:
            core_redis._async_clients.clear()
            await sync_to_async(connections.close_all)()

    return asyncio.run(run())


def cached(plaintext: str) -> bytes | None:
    from core.redis import sync_client

    return sync_client().get(key_cache.cache_key(keys.digest(plaintext)))


@pytest.fixture
def no_database(monkeypatch):
    """Makes the uncached (database) key lookup fail the test if it is reached."""

    def forbidden(**kwargs):
        raise AssertionError("the database was read")

    def forbid() -> None:
        monkeypatch.setattr("tenants.selectors.key_state_by_digest", forbidden)

    return forbid


def test_a_lookup_fills_the_cache_and_the_next_one_does_not_touch_the_database(no_database):
    tenant = tenant_factory()
    key = key_factory(tenant)
    assert cached(key.plaintext) is None
    first = lookup(key.plaintext)
    assert isinstance(first, Principal) and first.tenant_id == tenant.pk
    assert cached(key.plaintext) is not None
    no_database()
    assert lookup(key.plaintext) == first


def test_malformed_and_wrong_checksum_keys_are_refused_before_any_lookup(no_database):
    no_database()
    good = keys.generate().plaintext
    wrong_checksum = good[:-1] + ("A" if good[-1] != "A" else "B")
    for candidate in ("", "atr_short", "sk-" + "a" * 40, wrong_checksum, good + "x"):
        assert lookup(candidate) == key_cache.DENIED_MALFORMED


def test_revocation_is_immediate_although_the_key_was_cached():
    tenant = tenant_factory()
    key = key_factory(tenant)
    assert isinstance(lookup(key.plaintext), Principal)
    api_key_revoke(tenant=tenant, key_id=key.id)
    assert lookup(key.plaintext) == "revoked"


def test_a_fill_that_raced_a_change_cannot_restore_the_old_state():
    tenant = tenant_factory()
    key = key_factory(tenant)
    stale = principal_from_api_key(plaintext=key.plaintext)  # read before the revoke...
    api_key_revoke(tenant=tenant, key_id=key.id)

    async def late_fill():
        try:
            client = core_redis.async_client()
            # ...stored after it, as principal_lookup stores fills: NX.
            return await client.set(key_cache.cache_key(keys.digest(key.plaintext)),
                                    stale.encode(), nx=True, ex=60)
        finally:
            core_redis._async_clients.clear()

    assert not asyncio.run(late_fill())
    assert lookup(key.plaintext) == "revoked"


def test_scope_and_limit_changes_reach_the_cached_principal_at_once():
    tenant = tenant_factory(plan=plan_factory(priority=2, requests_per_minute=50))
    key = key_factory(tenant)
    assert lookup(key.plaintext).tenant_limits.requests_per_minute == 50
    api_key_update(tenant=tenant, key_id=key.id, actor=SYSTEM, scopes=["inference", "usage"])
    api_key_quota_update(tenant=tenant, key_id=key.id, actor=SYSTEM,
                         changes={"tokens_per_minute": 777})
    tenant_quota_update(tenant=tenant, actor=SYSTEM, changes={"requests_per_minute": 9})
    principal = lookup(key.plaintext)
    assert principal.scopes == ("inference", "usage")
    assert principal.key_limits.tokens_per_minute == 777
    assert principal.tenant_limits.requests_per_minute == 9
    assert principal.priority == 2
    tenant_update(tenant=tenant, actor=SYSTEM, plan=plan_factory(priority=0))
    assert lookup(key.plaintext).priority == 0


@pytest.mark.parametrize("rotated, reason", [(False, "expired"), (True, "rotated")])
def test_a_cached_key_past_its_expiry_is_refused(rotated, reason):
    import dataclasses
    import time

    from core.redis import sync_client

    tenant = tenant_factory()
    key = key_factory(tenant, expires_at=timezone.now() + timedelta(hours=1))
    principal = lookup(key.plaintext)
    assert isinstance(principal, Principal)
    # The entry's TTL ends at the expiry anyway; a clock that ran past it is refused too.
    past = dataclasses.replace(principal, expires_at=time.time() - 1, rotated=rotated)
    sync_client().set(key_cache.cache_key(keys.digest(key.plaintext)), past.encode())
    assert lookup(key.plaintext) == reason


def test_a_cached_key_lives_no_longer_than_its_expiry():
    from core.redis import sync_client

    tenant = tenant_factory()
    key = key_factory(tenant, expires_at=timezone.now() + timedelta(seconds=5))
    lookup(key.plaintext)
    assert 0 < sync_client().ttl(key_cache.cache_key(keys.digest(key.plaintext))) <= 5


def test_expiry_must_be_in_the_future_and_scopes_known():
    tenant = tenant_factory()
    with pytest.raises(InvalidRequest):
        api_key_create(tenant=tenant, name="x", expires_at=timezone.now())
    with pytest.raises(InvalidRequest):
        api_key_create(tenant=tenant, name="x", scopes=["inference", "superuser"])
    with pytest.raises(InvalidRequest):
        api_key_create(tenant=tenant, name="x", scopes=[])
    assert not ApiKey.objects.filter(tenant=tenant).exists()


def test_rotation_keeps_the_old_key_for_the_grace_period_only():
    tenant = tenant_factory()
    old = key_factory(tenant, scopes=["inference", "usage"])
    api_key_quota_update(tenant=tenant, key_id=old.id, actor=SYSTEM,
                         changes={"requests_per_minute": 3})
    new, plaintext = api_key_rotate(tenant=tenant, key_id=old.id, grace_seconds=60)
    assert new.scopes == ["inference", "usage"]
    assert isinstance(lookup(old.plaintext), Principal)
    rotated = lookup(plaintext)
    assert rotated.key_limits.requests_per_minute == 3 and not rotated.rotated
    assert lookup(old.plaintext).rotated
    with pytest.raises(Conflict):
        api_key_rotate(tenant=tenant, key_id=old.id)
    # Past the grace deadline the old key fails, and says why.
    ApiKey.objects.filter(pk=old.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    from core.redis import sync_client

    # The cached entry's TTL ends at the grace deadline (next test); here it has run out.
    sync_client().delete(key_cache.cache_key(keys.digest(old.plaintext)))
    assert lookup(old.plaintext) == "rotated"
    assert isinstance(lookup(plaintext), Principal)


def test_rotations_keep_the_first_keys_lineage_for_budgets_and_key_counters():
    tenant = tenant_factory()
    first = key_factory(tenant)
    second, second_text = api_key_rotate(tenant=tenant, key_id=first.id, grace_seconds=60)
    third, third_text = api_key_rotate(tenant=tenant, key_id=second.id, grace_seconds=60)
    assert (second.lineage_id, third.lineage_id) == (first.id, first.id)
    assert lookup(first.plaintext).key_lineage == first.id
    assert lookup(second_text).key_lineage == first.id
    assert lookup(third_text).key_lineage == first.id
    other = key_factory(tenant)
    assert lookup(other.plaintext).key_lineage == other.id


def test_a_rotated_key_is_cached_no_longer_than_its_grace_period():
    from core.redis import sync_client

    tenant = tenant_factory()
    old = key_factory(tenant)
    api_key_rotate(tenant=tenant, key_id=old.id, grace_seconds=5)
    ttl = sync_client().ttl(key_cache.cache_key(keys.digest(old.plaintext)))
    assert 0 < ttl <= 5


def test_revoking_a_rotated_key_ends_its_grace_at_once():
    tenant = tenant_factory()
    old = key_factory(tenant)
    api_key_rotate(tenant=tenant, key_id=old.id, grace_seconds=3600)
    api_key_revoke(tenant=tenant, key_id=old.id)
    assert lookup(old.plaintext) == "revoked"


def test_changes_are_audited_and_secrets_never_are():
    tenant = tenant_factory()
    key = key_factory(tenant)
    new, plaintext = api_key_rotate(tenant=tenant, key_id=key.id)
    api_key_revoke(tenant=tenant, key_id=new.pk)
    actions = list(AuditEvent.objects.filter(tenant=tenant).order_by("id")
                   .values_list("action", flat=True))
    assert actions == ["tenant.create", "api_key.create", "api_key.rotate", "api_key.create",
                       "api_key.revoke"]
    dump = str(list(AuditEvent.objects.filter(tenant=tenant).values()))
    for secret in (key.plaintext, plaintext, keys.digest(plaintext)):
        assert secret not in dump


@pytest.fixture
def redis_down(settings):
    """Every Redis client of the platform points at a port nobody listens on."""
    from core.redis import sync_client

    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    sync_client.cache_clear()
    core_redis._async_clients.clear()
    yield
    sync_client.cache_clear()
    core_redis._async_clients.clear()


def test_lookups_fail_closed_when_redis_is_down(redis_down):
    tenant = tenant_factory()
    key = key_factory(tenant)
    with pytest.raises(ServiceUnavailable):
        lookup(key.plaintext)


def test_a_revocation_that_cannot_reach_the_cache_changes_nothing(redis_down):
    tenant = tenant_factory()
    key = key_factory(tenant)
    with pytest.raises(ServiceUnavailable):
        api_key_revoke(tenant=tenant, key_id=key.id)
    assert ApiKey.objects.get(pk=key.id).revoked_at is None
    assert not AuditEvent.objects.filter(tenant=tenant, action="api_key.revoke").exists()


def test_tenant_scoped_querysets_refuse_no_tenant():
    with pytest.raises(ValueError):
        ApiKey.objects.for_tenant(None)
    with pytest.raises(ValueError):
        ApiKey.objects.for_tenant(Tenant(name="unsaved", slug="unsaved"))
