"""People in a tenant: members and their roles, invitations, and the audit log."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from core.errors import PermissionDenied
from tenants import access, selectors, services
from tenants.apis.base import Api, StrictSerializer, TenantApi, listing, validated
from tenants.apis.serializers import (
    AuditEventSerializer,
    InvitationSerializer,
    MembershipSerializer,
    list_of,
)
from tenants.models import Role

TAGS = ["members"]


class MemberListApi(TenantApi):
    OutputSerializer = list_of(MembershipSerializer, "MemberList")

    @extend_schema(tags=TAGS, summary="The tenant's members", responses=OutputSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "member.read")
        members = selectors.membership_list(tenant=tenant_access.tenant)
        return Response(listing(MembershipSerializer(members, many=True).data))


class MemberCreateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        email = serializers.EmailField(help_text="an existing user")
        role = serializers.ChoiceField(choices=Role.choices)

    @extend_schema(tags=TAGS, summary="Add an existing user directly (operators; others "
                   "invite)", request=InputSerializer, responses={201: MembershipSerializer})
    def post(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "member.add")
        data = validated(MemberCreateApi.InputSerializer, request.data)
        user = selectors.user_get_by_email(email=data["email"])
        membership = services.membership_create(tenant=tenant_access.tenant, user=user,
                                                role=data["role"], actor=tenant_access.actor)
        return Response(MembershipSerializer(membership).data, status=status.HTTP_201_CREATED)


class MemberDetailApi(TenantApi):
    @extend_schema(tags=TAGS, summary="One member", responses=MembershipSerializer)
    def get(self, request, slug: str, member_id: int) -> Response:
        tenant_access = self.access(slug)
        membership = selectors.membership_get(tenant=tenant_access.tenant,
                                              membership_id=member_id)
        access.authorize(tenant_access, "member.read")
        return Response(MembershipSerializer(membership).data)


def _managed_member(api: TenantApi, slug: str, member_id: int):
    """The membership (404 if not this tenant's) once the caller may change it (else 403)."""
    tenant_access = api.access(slug)
    membership = selectors.membership_get(tenant=tenant_access.tenant, membership_id=member_id)
    access.authorize(tenant_access, "member.manage")
    access.authorize_role(tenant_access, membership.role)  # only owners touch owners
    return tenant_access, membership


class MemberUpdateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        role = serializers.ChoiceField(choices=Role.choices)

    @extend_schema(tags=TAGS, summary="Change a member's role", request=InputSerializer,
                   responses=MembershipSerializer)
    def patch(self, request, slug: str, member_id: int) -> Response:
        tenant_access, membership = _managed_member(self, slug, member_id)
        role = validated(MemberUpdateApi.InputSerializer, request.data)["role"]
        access.authorize_role(tenant_access, role)
        membership = services.membership_update(tenant=tenant_access.tenant,
                                                membership_id=membership.pk, role=role,
                                                actor=tenant_access.actor)
        return Response(MembershipSerializer(membership).data)


class MemberDeleteApi(TenantApi):
    @extend_schema(tags=TAGS, summary="Remove a member", responses={204: None})
    def delete(self, request, slug: str, member_id: int) -> Response:
        tenant_access, membership = _managed_member(self, slug, member_id)
        services.membership_delete(tenant=tenant_access.tenant, membership_id=membership.pk,
                                   actor=tenant_access.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- invitations ---------------------------------------------------------------------------

class InvitationListApi(TenantApi):
    OutputSerializer = list_of(InvitationSerializer, "InvitationList")

    @extend_schema(tags=TAGS, summary="The tenant's invitations", responses=OutputSerializer)
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "member.read")
        invitations = selectors.invitation_list(tenant=tenant_access.tenant)
        return Response(listing(InvitationSerializer(invitations, many=True).data))


class InvitationCreateApi(TenantApi):
    class InputSerializer(StrictSerializer):
        email = serializers.EmailField()
        role = serializers.ChoiceField(choices=Role.choices)

    class OutputSerializer(InvitationSerializer):
        token = serializers.CharField(help_text="give it to the invitee; shown this once")

    @extend_schema(tags=TAGS, summary="Invite someone (the token is shown once)",
                   request=InputSerializer, responses={201: OutputSerializer})
    def post(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "member.manage")
        data = validated(InvitationCreateApi.InputSerializer, request.data)
        access.authorize_role(tenant_access, data["role"])
        invitation, token = services.invitation_create(
            tenant=tenant_access.tenant, email=data["email"], role=data["role"],
            actor=tenant_access.actor,
            invited_by=request.user if getattr(request.user, "pk", None) else None)
        return Response({**InvitationSerializer(invitation).data, "token": token},
                        status=status.HTTP_201_CREATED)


class InvitationDetailApi(TenantApi):
    @extend_schema(tags=TAGS, summary="One invitation", responses=InvitationSerializer)
    def get(self, request, slug: str, invitation_id: int) -> Response:
        tenant_access = self.access(slug)
        invitation = selectors.invitation_get(tenant=tenant_access.tenant,
                                              invitation_id=invitation_id)
        access.authorize(tenant_access, "member.read")
        return Response(InvitationSerializer(invitation).data)


class InvitationRevokeApi(TenantApi):
    @extend_schema(tags=TAGS, summary="Revoke an invitation", responses=InvitationSerializer)
    def delete(self, request, slug: str, invitation_id: int) -> Response:
        tenant_access = self.access(slug)
        invitation = selectors.invitation_get(tenant=tenant_access.tenant,
                                              invitation_id=invitation_id)
        access.authorize(tenant_access, "member.manage")
        access.authorize_role(tenant_access, invitation.role)
        invitation = services.invitation_revoke(tenant=tenant_access.tenant,
                                                invitation_id=invitation.pk,
                                                actor=tenant_access.actor)
        return Response(InvitationSerializer(invitation).data)


class InvitationAcceptApi(Api):
    class InputSerializer(StrictSerializer):
        token = serializers.CharField(max_length=200)

    class OutputSerializer(serializers.Serializer):
        tenant = serializers.SlugField()
        member = MembershipSerializer()

    @extend_schema(tags=TAGS, summary="Accept an invitation as the signed-in user",
                   request=InputSerializer, responses={201: OutputSerializer})
    def post(self, request) -> Response:
        if self.actor().principal is not None:
            raise PermissionDenied("invitations are accepted by a signed-in person, not a key")
        token = validated(InvitationAcceptApi.InputSerializer, request.data)["token"]
        membership = services.invitation_accept(token=token, user=request.user)
        return Response({"tenant": membership.tenant.slug,
                         "member": MembershipSerializer(membership).data},
                        status=status.HTTP_201_CREATED)


# --- audit log -----------------------------------------------------------------------------

class AuditEventListApi(TenantApi):
    OutputSerializer = list_of(AuditEventSerializer, "AuditEventList")

    class FilterSerializer(StrictSerializer):
        limit = serializers.IntegerField(min_value=1, max_value=200, default=50)
        before = serializers.IntegerField(min_value=1, required=False,
                                          help_text="only events older than this id")
        action = serializers.CharField(max_length=64, required=False)

    @extend_schema(tags=["audit"], summary="Changes to keys, members, roles and quotas, "
                   "newest first", responses=OutputSerializer,
                   parameters=[OpenApiParameter("limit", int), OpenApiParameter("before", int),
                               OpenApiParameter("action", str)])
    def get(self, request, slug: str) -> Response:
        tenant_access = self.access(slug)
        access.authorize(tenant_access, "audit.read")
        query = validated(AuditEventListApi.FilterSerializer, request.query_params.dict())
        events = selectors.audit_event_list(tenant=tenant_access.tenant).order_by("-id")
        if "before" in query:
            events = events.filter(id__lt=query["before"])
        if "action" in query:
            events = events.filter(action=query["action"])
        page = list(events[:query["limit"] + 1])
        return Response(listing(AuditEventSerializer(page[:query["limit"]], many=True).data,
                                has_more=len(page) > query["limit"]))
