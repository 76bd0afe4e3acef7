"""Writing adapters: registering a checked PEFT folder, making one public, deleting one."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from adapters.models import Adapter, AdapterStatus, Visibility
from adapters.naming import NAME
from tenants.models import Tenant


class AdapterRejected(ValueError):
    """The adapter cannot be served; the message says why, for a person."""


def adapter_store():
    from engine.lora.store import AdapterStore

    return AdapterStore(settings.ATRIUM_ADAPTER_STORE)


def adapter_check(*, source_dir: Path, base_model_dir: Path) -> dict:
    """Reads and checks a PEFT folder against the base model; facts about it, or raises.

    NOTE: imports torch: run it in a worker or a command, never on the web hot path.
    """
    from engine.lora.adapter import AdapterError, load_adapter
    from engine.models.llama import ModelConfig

    try:
        loaded = load_adapter(source_dir, ModelConfig.from_dir(base_model_dir),
                              max_rank=settings.ATRIUM_MAX_LORA_RANK)
    except AdapterError as exc:
        raise AdapterRejected(str(exc)) from None
    return {"rank": loaded.rank,
            "target_modules": sorted({module for _, module in loaded.modules}),
            "size_bytes": loaded.nbytes}


def adapter_register(*, tenant: Tenant, name: str, source_dir: Path, base_model: str,
                     base_model_dir: Path, public: bool = False) -> Adapter:
    """Checks a PEFT folder, stores it by content hash, and records it as the next version."""
    if not NAME.match(name):
        raise AdapterRejected("adapter names are 1-64 lowercase letters, digits, '.', '_' or "
                              "'-', starting with a letter or digit")
    facts = adapter_check(source_dir=source_dir, base_model_dir=base_model_dir)
    content_hash = adapter_store().put(source_dir)
    with transaction.atomic():
        # NOTE: the tenant row is locked so two registrations never pick the same version.
        Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        latest = Adapter.objects.for_tenant(tenant).filter(name=name).aggregate(
            v=Max("version"))["v"] or 0
        now = timezone.now()
        return Adapter.objects.create(
            tenant=tenant, name=name, version=latest + 1, base_model=base_model,
            status=AdapterStatus.READY, content_hash=content_hash,
            visibility=Visibility.PUBLIC if public else Visibility.PRIVATE,
            created_at=now, updated_at=now, **facts)


def adapter_set_visibility(*, adapter: Adapter, public: bool) -> Adapter:
    """Operators only (callers check): a public adapter is callable by every tenant."""
    adapter.visibility = Visibility.PUBLIC if public else Visibility.PRIVATE
    adapter.updated_at = timezone.now()
    adapter.save(update_fields=["visibility", "updated_at"])
    return adapter

