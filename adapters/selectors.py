"""Reading adapters: which one a request's ``model`` means, and which a tenant may use."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q

from adapters.models import Adapter, AdapterStatus, AdapterUpload, Visibility
from adapters.naming import ModelRef, model_id


class AdapterNotFound(LookupError):
    """Unknown, or not the caller's to use (the two are not told apart)."""


class AdapterNotReady(Exception):
    def __init__(self, status: str, reason: str = "") -> None:
        super().__init__(status)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    model_id: str  # what a client passes as ``model``
    name: str
    version: int
    owner_slug: str
    content_hash: str
    created: int  # unix seconds

    @property
    def display_name(self) -> str:
        """How usage records and logs name it: owner/name@version."""
        return f"{self.owner_slug}/{self.name}@{self.version}"


def _served(adapter: Adapter, *, base: str, caller_slug: str, pinned_version: bool
            ) -> ServedAdapter:
    owner = adapter.tenant.slug
    return ServedAdapter(
        model_id=model_id(base=base, name=adapter.name,
                          owner=None if owner == caller_slug else owner,
                          version=adapter.version if pinned_version else None),
        name=adapter.name, version=adapter.version, owner_slug=owner,
        content_hash=adapter.content_hash, created=int(adapter.created_at.timestamp()))


def adapter_resolve(*, tenant_id: int, tenant_slug: str, ref: ModelRef) -> ServedAdapter:
    """The ready adapter ``ref`` names for this tenant: its own, or another's public one."""
    assert ref.adapter is not None
    candidates = Adapter.objects.select_related("tenant").filter(
        base_model=ref.base, name=ref.adapter)
    if ref.owner is None or ref.owner == tenant_slug:
        candidates = candidates.filter(tenant_id=tenant_id)
    else:
        candidates = candidates.filter(tenant__slug=ref.owner, visibility=Visibility.PUBLIC)
    if ref.version is not None:
        candidates = candidates.filter(version=ref.version)
    ready = candidates.filter(status=AdapterStatus.READY).order_by("-version").first()
    if ready is not None:
        return _served(ready, base=ref.base, caller_slug=tenant_slug,
                       pinned_version=ref.version is not None)
    newest = candidates.order_by("-version").first()
    if newest is None:
        raise AdapterNotFound(ref.adapter)
    raise AdapterNotReady(newest.status, newest.failure_reason)


def adapter_list_usable(*, tenant_id: int, tenant_slug: str, base: str) -> list[ServedAdapter]:
    """The newest ready version of each adapter the tenant may call: its own, then public."""
    rows = (Adapter.objects.select_related("tenant")
            .filter(base_model=base, status=AdapterStatus.READY)
            .filter(Q(tenant_id=tenant_id) | Q(visibility=Visibility.PUBLIC))
            .order_by("tenant_id", "name", "-version"))
    newest: dict[tuple[int, str], Adapter] = {}
    for row in rows:
        newest.setdefault((row.tenant_id, row.name), row)
    served = [_served(a, base=base, caller_slug=tenant_slug, pinned_version=False)
              for a in newest.values()]
    return sorted(served, key=lambda s: (s.owner_slug != tenant_slug, s.model_id))


def adapter_list(*, tenant) -> list[Adapter]:
    return list(Adapter.objects.for_tenant(tenant).order_by("name", "-version"))


def adapter_get(*, tenant, adapter_id: int) -> Adapter:
    """The tenant's adapter version; another tenant's id is a 404 (NotFound)."""
    from core.errors import NotFound

    adapter = Adapter.objects.for_tenant(tenant).filter(pk=adapter_id).first()
    if adapter is None:
        raise NotFound(f"no adapter {adapter_id} in this tenant")
    return adapter


def upload_get(*, tenant, upload_id) -> AdapterUpload:
    from core.errors import NotFound

    upload = AdapterUpload.objects.for_tenant(tenant).filter(pk=upload_id).first()
    if upload is None:
        raise NotFound(f"no upload {upload_id} in this tenant")
    return upload


def adapter_list_all(*, visibility: str | None = None) -> list[Adapter]:
    """Every tenant's adapters (the operator's view), newest first; optionally one visibility."""
    rows = Adapter.objects.select_related("tenant")
    if visibility is not None:
        rows = rows.filter(visibility=visibility)
    return list(rows.order_by("tenant__slug", "name", "-version"))
