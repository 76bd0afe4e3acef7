"""People: console users, their memberships of tenants (a tenant keeps an owner), and
invitations to join one."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.utils import timezone

from core.errors import Conflict, InvalidRequest, NotFound, PermissionDenied
from tenants.access import SYSTEM, Actor
from tenants.models import Invitation, Membership, Role, Tenant
from tenants.services.audit import audit_record

INVITATION_PREFIX = "atrinv_"


def user_create(*, email: str, password: str | None = None, is_staff: bool = False,
                first_name: str = "", last_name: str = ""):
    """A console user (username = email). No password: they cannot sign in until one is set."""
    email = get_user_model().objects.normalize_email(email.strip()).lower()
    if not email or "@" not in email:
        raise InvalidRequest("a user needs an email address", param="email",
                             code="invalid_value")
    users = get_user_model().objects
    if users.filter(email__iexact=email).exists() or users.filter(username=email).exists():
        raise Conflict(f"a user with the email {email!r} exists already", param="email")
    # NOTE: create_user with no password stores an unusable one.
    return users.create_user(username=email, email=email, password=password,
                             is_staff=is_staff, first_name=first_name, last_name=last_name)


def _membership_snapshot(membership: Membership) -> dict[str, Any]:
    return {"user": membership.user.email or membership.user.get_username(),
            "role": membership.role}


def _owner_count(tenant: Tenant) -> int:
    return Membership.objects.for_tenant(tenant).filter(role=Role.OWNER).count()


def _validated_role(role: str) -> str:
    if role not in Role.values:
        raise InvalidRequest(f"unknown role {role!r}; known: {Role.values}", param="role",
                             code="invalid_value")
    return role


@transaction.atomic
def membership_create(*, tenant: Tenant, user, role: str,
                      actor: Actor = SYSTEM) -> Membership:
    """Adds an existing user to the tenant (operators, and accepted invitations)."""
    role = _validated_role(role)
    try:
        with transaction.atomic():
            membership = Membership.objects.create(tenant=tenant, user=user, role=role)
    except IntegrityError as exc:
        raise Conflict(f"{user.email or user.get_username()} is a member already",
                       param="email") from exc
    audit_record(tenant=tenant, actor=actor, action="member.create", target_type="member",
                 target_id=membership.pk, after=_membership_snapshot(membership))
    return membership


def _locked_membership(*, tenant: Tenant, membership_id: int) -> Membership:
    membership = (Membership.objects.for_tenant(tenant).select_for_update(of=("self",))
                  .select_related("user").filter(pk=membership_id).first())
    if membership is None:
        raise NotFound(f"no member {membership_id} in tenant '{tenant.slug}'")
    return membership


@transaction.atomic
def membership_update(*, tenant: Tenant, membership_id: int, role: str,
                      actor: Actor) -> Membership:
    role = _validated_role(role)
    Tenant.objects.select_for_update().get(pk=tenant.pk)  # serialises owner-count checks
    membership = _locked_membership(tenant=tenant, membership_id=membership_id)
    before = _membership_snapshot(membership)
    if membership.role == Role.OWNER and role != Role.OWNER and _owner_count(tenant) == 1:
        raise Conflict("a tenant keeps at least one owner; make someone else owner first",
                       param="role")
    membership.role = role
    membership.save(update_fields=["role"])
    audit_record(tenant=tenant, actor=actor, action="member.update", target_type="member",
                 target_id=membership.pk, before=before,
                 after=_membership_snapshot(membership))
    return membership


@transaction.atomic
def membership_delete(*, tenant: Tenant, membership_id: int, actor: Actor) -> None:
    Tenant.objects.select_for_update().get(pk=tenant.pk)
    membership = _locked_membership(tenant=tenant, membership_id=membership_id)
    if membership.role == Role.OWNER and _owner_count(tenant) == 1:
        raise Conflict("a tenant keeps at least one owner; make someone else owner first")
    before = _membership_snapshot(membership)
    membership_pk = membership.pk
    membership.delete()
    audit_record(tenant=tenant, actor=actor, action="member.delete", target_type="member",
                 target_id=membership_pk, before=before)


def _invitation_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _invitation_snapshot(invitation: Invitation) -> dict[str, Any]:
    return {"email": invitation.email, "role": invitation.role,
            "expires_at": invitation.expires_at, "accepted_at": invitation.accepted_at,
            "revoked_at": invitation.revoked_at}


@transaction.atomic
def invitation_create(*, tenant: Tenant, email: str, role: str, actor: Actor,
                      invited_by=None) -> tuple[Invitation, str]:
    """Returns the invitation and its token, which is shown once (only a digest is kept)."""
    role = _validated_role(role)
    email = email.strip().lower()
    if Membership.objects.for_tenant(tenant).filter(user__email__iexact=email).exists():
        raise Conflict(f"{email} is a member already", param="email")
    token = INVITATION_PREFIX + secrets.token_urlsafe(32)
    invitation = Invitation.objects.create(
        tenant=tenant, email=email, role=role, digest=_invitation_digest(token),
        invited_by=invited_by,
        expires_at=timezone.now() + timedelta(seconds=settings.ATRIUM_INVITATION_TTL_S))
    audit_record(tenant=tenant, actor=actor, action="invitation.create",
                 target_type="invitation", target_id=invitation.pk,
                 after=_invitation_snapshot(invitation))
    return invitation, token


@transaction.atomic
def invitation_revoke(*, tenant: Tenant, invitation_id: int, actor: Actor) -> Invitation:
    invitation = (Invitation.objects.for_tenant(tenant).select_for_update()
                  .filter(pk=invitation_id).first())
    if invitation is None:
        raise NotFound(f"no invitation {invitation_id} in tenant '{tenant.slug}'")
    if invitation.accepted_at is not None:
        raise Conflict("this invitation was accepted already")
    if invitation.revoked_at is None:
        before = _invitation_snapshot(invitation)
        invitation.revoked_at = timezone.now()
        invitation.save(update_fields=["revoked_at"])
        audit_record(tenant=tenant, actor=actor, action="invitation.revoke",
                     target_type="invitation", target_id=invitation.pk, before=before,
                     after=_invitation_snapshot(invitation))
    return invitation


@transaction.atomic
def invitation_accept(*, token: str, user) -> Membership:
    """The signed-in user joins the tenant with the invited role.

    The invitation must be live and addressed to the user's email.
    """
    invitation = (Invitation.objects.select_for_update().select_related("tenant")
                  .filter(digest=_invitation_digest(token or "")).first())
    if (invitation is None or invitation.revoked_at is not None
            or invitation.accepted_at is not None or invitation.expires_at <= timezone.now()):
        raise NotFound("this invitation does not exist, has expired or was used already",
                       param="token", code="invitation_not_found")
    if (user.email or "").lower() != invitation.email:
        raise PermissionDenied("this invitation was sent to another email address",
                               param="token")
    before = _invitation_snapshot(invitation)
    actor = Actor(user_id=user.pk, user_email=user.email)
    membership = membership_create(tenant=invitation.tenant, user=user, role=invitation.role,
                                   actor=actor)
    invitation.accepted_at = timezone.now()
    invitation.accepted_by = user
    invitation.save(update_fields=["accepted_at", "accepted_by"])
    audit_record(tenant=invitation.tenant, actor=actor, action="invitation.accept",
                 target_type="invitation", target_id=invitation.pk, before=before,
                 after=_invitation_snapshot(invitation))
    return membership
