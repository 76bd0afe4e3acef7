"""The audit log: who changed what in a tenant (or the platform), before and after."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tenants.access import Actor
from tenants.models import AuditEvent, Tenant


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def audit_record(*, tenant: Tenant | None, actor: Actor, action: str, target_type: str,
                 target_id: Any, before: dict[str, Any] | None = None,
                 after: dict[str, Any] | None = None) -> AuditEvent:
    return AuditEvent.objects.create(
        tenant=tenant, actor_user_id=actor.user_id, actor=actor.label,
        actor_key_prefix=actor.principal.api_key_prefix if actor.principal else "",
        action=action, target_type=target_type, target_id=str(target_id),
        before={k: _jsonable(v) for k, v in before.items()} if before is not None else None,
        after={k: _jsonable(v) for k, v in after.items()} if after is not None else None)
