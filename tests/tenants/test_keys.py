import pytest
from hypothesis import given
from hypothesis import strategies as st

from tenants import keys
from tenants.models import ApiKey
from tenants.selectors import principal_from_api_key
from tenants.services import api_key_create, api_key_revoke, tenant_create


def test_generated_key_is_well_formed_with_a_recognisable_prefix():
    secret = keys.generate()
    assert secret.plaintext.startswith("atr_")
    assert len(secret.plaintext) == keys.KEY_LENGTH
    assert keys.is_well_formed(secret.plaintext)
    assert secret.plaintext.startswith(secret.prefix)


def test_a_changed_character_fails_the_checksum():
    plaintext = keys.generate().plaintext
    i = 10
    swapped = "A" if plaintext[i] != "A" else "B"
    assert not keys.is_well_formed(plaintext[:i] + swapped + plaintext[i + 1:])


@given(st.text(max_size=60))
def test_random_strings_are_not_keys(text):
    assert not keys.is_well_formed(text)


@pytest.mark.django_db
def test_only_the_digest_is_stored():
    tenant = tenant_create(name="Acme")
    key, plaintext = api_key_create(tenant=tenant, name="ci")
    stored = ApiKey.objects.get(pk=key.pk)
    assert plaintext not in {stored.digest, stored.prefix, stored.name}
    assert stored.digest == keys.digest(plaintext)
    assert len(stored.prefix) == keys.VISIBLE_PREFIX_CHARS


@pytest.mark.django_db
def test_revoked_key_no_longer_authenticates():
    tenant = tenant_create(name="Acme")
    key, plaintext = api_key_create(tenant=tenant, name="ci")
    assert principal_from_api_key(plaintext=plaintext).tenant_id == tenant.pk
    api_key_revoke(tenant=tenant, key_id=key.pk)
    assert principal_from_api_key(plaintext=plaintext) is None


@pytest.mark.django_db
def test_another_tenant_cannot_revoke_a_key():
    owner = tenant_create(name="Acme")
    other = tenant_create(name="Globex")
    key, plaintext = api_key_create(tenant=owner, name="ci")
    with pytest.raises(ApiKey.DoesNotExist):
        api_key_revoke(tenant=other, key_id=key.pk)
    assert principal_from_api_key(plaintext=plaintext) is not None
