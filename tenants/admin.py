from django.contrib import admin

from tenants.models import ApiKey, AuditEvent, Invitation, Membership, Plan, QuotaOverride, Tenant

admin.site.register(Plan)
admin.site.register(QuotaOverride)


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "plan", "created_at")


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("tenant", "user", "role", "created_at")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "name", "tenant", "scopes", "created_at", "expires_at",
                    "last_used_at", "revoked_at")
    readonly_fields = ("prefix", "digest", "created_at", "last_used_at")


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    list_display = ("tenant", "email", "role", "created_at", "expires_at", "accepted_at")
    readonly_fields = ("digest",)


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "tenant", "actor", "action", "target_type", "target_id")

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
