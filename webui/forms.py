"""The console's forms: they parse and validate what a person typed; services decide."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django import forms
from django.core.validators import MaxValueValidator, MinValueValidator

from billing.models import Export
from tenants.models import (
    MAX_FAIR_WEIGHT,
    MAX_RESIDENT_ADAPTERS,
    QUOTA_FIELDS,
    RESUME_GRACE_MAX_S,
    SERVICE_TIERS,
    Role,
    Scope,
)
from tenants.selectors import api_key_list
from tenants.services.quotas import RETENTION_MAX_DAYS

SCOPE_HELP = {
    Scope.INFERENCE: "call models (/v1)",
    Scope.ADAPTERS: "upload and manage adapters",
    Scope.USAGE: "read usage",
    Scope.BILLING: "read invoices, export billing data",
    Scope.ADMIN: "the management API: keys, members, quotas",
}


def _end_of_day(day) -> datetime:
    return datetime.combine(day, time(23, 59, 59), tzinfo=UTC)


class DayField(forms.DateField):
    """A calendar day (a date picker), within years a ledger can hold: the views add a day
    to an inclusive end, which `date.max` would overflow."""

    widget = forms.DateInput(attrs={"type": "date"})
    default_validators = [MinValueValidator(date(2000, 1, 1)),
                          MaxValueValidator(date(9998, 12, 31))]


class KeyCreateForm(forms.Form):
    name = forms.CharField(max_length=200, label="Name",
                           help_text="What it is for, e.g. “production backend”.")
    scopes = forms.MultipleChoiceField(widget=forms.CheckboxSelectMultiple, label="Scopes")
    expires_on = DayField(required=False, label="Expires on (optional)",
                          help_text="The key stops working at the end of this day (UTC).")

    def __init__(self, *args: Any, grantable: frozenset[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["scopes"].choices = [(s, f"{s} — {SCOPE_HELP[s]}") for s in Scope.values
                                         if s in grantable]
        self.fields["scopes"].initial = [Scope.INFERENCE.value]

    def expires_at(self) -> datetime | None:
        day = self.cleaned_data.get("expires_on")
        return _end_of_day(day) if day else None


class RotateForm(forms.Form):
    grace_hours = forms.IntegerField(min_value=0, max_value=7 * 24, initial=24,
                                     label="Old key keeps working for (hours)")

    def grace_seconds(self) -> int:
        return self.cleaned_data["grace_hours"] * 3600


class ExportForm(forms.Form):
    kind = forms.ChoiceField(choices=Export.Kind.choices, label="What")
    format = forms.ChoiceField(choices=Export.Format.choices, label="Format")
    start = DayField(label="From (UTC, inclusive)")
    end = DayField(label="To (UTC, inclusive)")

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("start") and data.get("end") and data["start"] > data["end"]:
            raise forms.ValidationError("“From” must not be after “To”.")
        return data

    def range(self) -> tuple[datetime, datetime]:
        start = datetime.combine(self.cleaned_data["start"], time(0), tzinfo=UTC)
        end = datetime.combine(self.cleaned_data["end"], time(0), tzinfo=UTC) + timedelta(days=1)
        return start, end


class AdapterUploadForm(forms.Form):
    name = forms.RegexField(r"^[a-z0-9][a-z0-9._-]{0,63}$", max_length=64, label="Name",
                            help_text="Lowercase letters, digits, “.”, “_” or “-”. "
                                      "A new upload under an existing name is its next version.")
    archive = forms.FileField(label="Adapter archive (.zip or .tar.gz)",
                              help_text="A PEFT folder: adapter_config.json and "
                                        "adapter_model.safetensors.")
    base_model = forms.ChoiceField(label="Base model", help_text="The served model it was "
                                   "trained on: requests for it run on that model's engines.")

    def __init__(self, *args, **kwargs) -> None:
        from core.served_models import served_models

        super().__init__(*args, **kwargs)
        names = list(served_models())
        self.fields["base_model"].choices = [(n, n) for n in names]
        self.fields["base_model"].initial = names[0]


class LogFilterForm(forms.Form):
    since = DayField(required=False, label="From (UTC)")
    until = DayField(required=False, label="To (UTC, inclusive)")
    model = forms.CharField(required=False, max_length=200, label="Model")
    adapter = forms.CharField(required=False, max_length=200, label="Adapter")
    key = forms.TypedChoiceField(required=False, coerce=int, empty_value=None, label="API key")
    status = forms.IntegerField(required=False, min_value=100, max_value=599, label="Status")

    def __init__(self, *args: Any, keys: list[tuple[int, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["key"].choices = [("", "any key"), *keys]

    def filters(self, *, before: int | None = None):
        """The filters; `before` is the page cursor, kept out of the form so that changing
        a filter on an older page starts again from the newest match."""
        from requestlogs.selectors import RequestLogFilter

        d = self.cleaned_data
        return RequestLogFilter(
            since=datetime.combine(d["since"], time(0), tzinfo=UTC) if d.get("since") else None,
            until=(datetime.combine(d["until"], time(0), tzinfo=UTC) + timedelta(days=1)
                   if d.get("until") else None),
            model=d.get("model") or None, adapter=d.get("adapter") or None,
            api_key_id=d.get("key"), status=d.get("status"), before=before)


class LogPolicyForm(forms.Form):
    log_bodies = forms.BooleanField(required=False, label="Keep prompts and completions "
                                    "(always redacted before they are stored)")
    retention_days = forms.IntegerField(min_value=1, label="Keep logs for (days)")


class InviteForm(forms.Form):
    email = forms.EmailField(label="Email")
    role = forms.ChoiceField(choices=Role.choices, label="Role", initial=Role.DEVELOPER)


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices, label="Role")


class AcceptInvitationForm(forms.Form):
    token = forms.CharField(max_length=200, label="Invitation token",
                            help_text="It starts with atrinv_.")


class AuditFilterForm(forms.Form):
    action = forms.CharField(required=False, max_length=64, label="Action",
                             help_text="e.g. api_key.create")


class UsageRangeForm(forms.Form):
    days = forms.TypedChoiceField(choices=[(7, "7 days"), (30, "30 days"), (90, "90 days")],
                                  coerce=int, initial=30, required=False, label="Range")


# --- the operator's ------------------------------------------------------------------------

def _limit(label: str) -> forms.IntegerField:
    return forms.IntegerField(required=False, min_value=1, label=label)


LIMIT_LABELS = {
    "requests_per_minute": "Requests per minute",
    "tokens_per_minute": "Tokens per minute",
    "max_concurrent_requests": "Concurrent requests",
    "max_prompt_tokens": "Max prompt tokens",
    "max_output_tokens": "Max output tokens",
    "monthly_token_cap": "Monthly token cap",
}


class QuotaOverrideForm(forms.Form):
    """Each empty field inherits the plan's limit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in QUOTA_FIELDS:
            self.fields[name] = _limit(LIMIT_LABELS[name])

    def changes(self) -> dict[str, int | None]:
        return {name: self.cleaned_data.get(name) for name in QUOTA_FIELDS}


class TenantCreateForm(forms.Form):
    name = forms.CharField(max_length=200, label="Name")
    slug = forms.SlugField(max_length=64, required=False, label="Slug (optional)")
    plan = forms.ChoiceField(label="Plan")
    owner_email = forms.EmailField(required=False, label="Owner's email (an existing user)")

    def __init__(self, *args: Any, plans: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["plan"].choices = plans


class TenantPlanForm(forms.Form):
    plan = forms.ChoiceField(label="Plan")

    def __init__(self, *args: Any, plans: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["plan"].choices = plans


class SpendCapForm(forms.Form):
    choice = forms.ChoiceField(choices=[("inherit", "the plan's cap"), ("none", "no cap"),
                                        ("amount", "this amount")], label="Monthly spend cap",
                               widget=forms.RadioSelect)
    monthly_limit = forms.DecimalField(required=False, min_value=0, max_digits=14,
                                       decimal_places=2, label="Amount")

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("choice") == "amount" and data.get("monthly_limit") is None:
            raise forms.ValidationError("Give the amount of the cap.")
        return data


class MemberAddForm(forms.Form):
    email = forms.EmailField(label="Email")
    role = forms.ChoiceField(choices=Role.choices, label="Role")
    password = forms.CharField(required=False, widget=forms.PasswordInput(
        attrs={"autocomplete": "new-password"}), label="Password (new people only)",
        help_text="For someone without an account yet: their account is created with it.")

    def clean_password(self) -> str:
        password = self.cleaned_data.get("password") or ""
        if password:
            from django.contrib.auth.password_validation import validate_password

            validate_password(password)
        return password


class PlanForm(forms.Form):
    slug = forms.SlugField(max_length=64, label="Slug")
    name = forms.CharField(max_length=200, label="Name")
    priority = forms.IntegerField(min_value=-100, max_value=100, initial=5,
                                  label="Priority class (lower runs first)")
    requests_per_minute = forms.IntegerField(min_value=1, label="Requests per minute")
    tokens_per_minute = forms.IntegerField(min_value=1, label="Tokens per minute")
    max_concurrent_requests = forms.IntegerField(min_value=1, label="Concurrent requests")
    max_prompt_tokens = _limit("Max prompt tokens (empty: none)")
    max_output_tokens = _limit("Max output tokens (empty: none)")
    monthly_token_cap = _limit("Monthly token cap (empty: none)")
    max_files = _limit("Files a tenant keeps (empty: the server's default)")
    max_file_bytes = _limit("Bytes of files a tenant keeps (empty: the server's default)")
    max_active_batches = _limit("Batches a tenant has running or waiting (empty: the "
                                "server's default)")
    response_retention_days = forms.IntegerField(
        required=False, min_value=0, max_value=RETENTION_MAX_DAYS,
        label="Days a stored Responses API response is kept (empty: the server's default; "
              "0: none stored)")
    resume_grace_s = forms.IntegerField(
        required=False, min_value=0, max_value=RESUME_GRACE_MAX_S,
        label="Seconds a resumable stream keeps generating after its client disconnects, at "
              "most (empty: the server's default; 0: resumable streams off)")
    service_tiers = forms.MultipleChoiceField(
        choices=[(t, t) for t in SERVICE_TIERS], initial=["default", "flex"], required=False,
        widget=forms.CheckboxSelectMultiple,
        label="Service tiers its tenants may ask for (none checked: default and flex on a new "
              "plan, unchanged on a saved one)")
    default_service_tier = forms.ChoiceField(
        choices=[("", "—"), *((t, t) for t in SERVICE_TIERS)], initial="default",
        required=False, label="Service tier of a request that asks for none")
    fair_weight = forms.FloatField(min_value=0.001, max_value=MAX_FAIR_WEIGHT, initial=1.0,
                                   required=False, label="Weight in token-fair scheduling")
    extended_prompt_cache = forms.BooleanField(
        required=False, label="Tenants may keep their prompt cache a day "
                              "(prompt_cache_retention '24h')")
    max_resident_adapters = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_RESIDENT_ADAPTERS,
        label="LoRA adapters of a tenant an engine holds at once (empty: no limit but its "
              "fair share)")

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        # NOTE: a field left empty is not sent on: the plan's (or a new plan's) value stands.
        for field in ("service_tiers", "default_service_tier", "fair_weight"):
            if cleaned.get(field) in (None, "", []):
                cleaned.pop(field, None)
        return cleaned


class PlanUpdateForm(PlanForm):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        del self.fields["slug"]


class PlanSpendCapForm(forms.Form):
    monthly_limit = forms.DecimalField(required=False, min_value=0, max_digits=14,
                                       decimal_places=2,
                                       label="Default monthly spend cap (empty: none)")


class PriceForm(forms.Form):
    model = forms.CharField(max_length=200, label="Model")
    adapter = forms.CharField(max_length=200, required=False,
                              label="Adapter (empty: the model's base price)",
                              help_text="Set: a surcharge added to the base price.")
    input_per_million = forms.DecimalField(min_value=0, max_digits=18, decimal_places=6,
                                           label="Input, per million tokens")
    cached_input_per_million = forms.DecimalField(min_value=0, max_digits=18, decimal_places=6,
                                                  label="Cached input, per million tokens")
    output_per_million = forms.DecimalField(min_value=0, max_digits=18, decimal_places=6,
                                            label="Output, per million tokens")
    embedding_per_million = forms.DecimalField(
        min_value=0, max_digits=18, decimal_places=6, required=False,
        label="Embeddings, per million tokens",
        help_text="Empty: embeddings are billed at the input price.")
    flex_ratio = forms.DecimalField(min_value=0, max_value=1, max_digits=7, decimal_places=6,
                                    initial="0.5", required=False,
                                    label="Flex tier: share of these prices (empty: 0.5)")
    priority_ratio = forms.DecimalField(min_value=1, max_value=10, max_digits=8,
                                        decimal_places=6, initial="2", required=False,
                                        label="Priority tier: multiple of these prices "
                                              "(empty: 2)")
    effective_from = forms.DateTimeField(required=False, label="From (UTC; empty: now)",
                                         widget=forms.DateTimeInput(
                                             attrs={"type": "datetime-local"}))

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        for field in ("flex_ratio", "priority_ratio"):  # empty: the price book's default
            if cleaned.get(field) is None:
                cleaned.pop(field, None)
        return cleaned


class BudgetForm(forms.Form):
    scope = forms.ChoiceField(choices=[("tenant", "The whole tenant"), ("key", "One API key"),
                                       ("user", "End users (the request's user)")],
                              label="Applies to")
    api_key_id = forms.TypedChoiceField(coerce=int, required=False, empty_value=None,
                                        label="API key (key budgets)")
    end_user = forms.CharField(max_length=256, required=False, label="End user (blank: each)")
    window = forms.ChoiceField(choices=[("day", "per UTC day"), ("month", "per UTC month")],
                               label="Window")
    spend_limit = forms.DecimalField(max_digits=14, decimal_places=2, min_value=0,
                                     required=False, label="Spend limit")
    token_limit = forms.IntegerField(min_value=0, required=False, label="Token limit")

    def __init__(self, *args: Any, tenant, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["api_key_id"].choices = [("", "—")] + [
            (k.pk, f"{k.name} ({k.prefix}…)") for k in api_key_list(tenant=tenant)]

    def budget(self) -> dict[str, Any]:
        data = self.cleaned_data
        out = {"scope": data["scope"], "window": data["window"],
               "spend_limit": data.get("spend_limit"), "token_limit": data.get("token_limit")}
        if data["scope"] == "key":
            out["api_key_id"] = data.get("api_key_id")
        if data["scope"] == "user":
            out["end_user"] = data.get("end_user") or ""
        return out


class WebhookForm(forms.Form):
    url = forms.URLField(max_length=2000, label="Endpoint URL", assume_scheme="https")
    description = forms.CharField(max_length=200, required=False, label="Description")
