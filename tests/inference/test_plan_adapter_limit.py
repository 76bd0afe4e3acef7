"""A plan's limit on resident adapters travels with each of its tenants' requests to the
engine (engine/lora/slots.py enforces it); a plan without one sends none."""

from __future__ import annotations

from tests.live import make_tenant_key


def _chat(model: str) -> dict:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def test_the_plans_adapter_limit_is_on_the_engine_request(transactional_db, served_model):
    from inference import service
    from tenants.models import ApiKey, Plan
    from tenants.selectors import principal_for_key

    tenant = make_tenant_key("adapter-capped")

    def prepared():
        principal = principal_for_key(ApiKey.objects.select_related("tenant__plan")
                                      .get(pk=tenant.key_id))
        return service.prepare(principal=principal, kind="chat",
                               body=_chat(served_model)).engine_request

    assert prepared().max_resident_adapters == 0  # no limit
    Plan.objects.filter(tenants__id=tenant.tenant_id).update(max_resident_adapters=2)
    assert prepared().max_resident_adapters == 2
