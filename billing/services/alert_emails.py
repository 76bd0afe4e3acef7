"""Budget alerts by email, in the alerts lane: one task per alert, a wall-clock deadline
on the SMTP conversation, one tenant's emails at a time, and text built safely from
whatever a tenant's end users are called."""

from __future__ import annotations

import logging

from django.conf import settings

from billing.models import BudgetAlert
from billing.services.budgets import alert_event
from core import lanes
from core.mail import MailTimeout, header_text, send_within
from tenants.facade import tenant_payer_emails

log = logging.getLogger(__name__)

LANE = "alerts"


def budget_alert_email(*, alert_id: int) -> int:
    """Emails one alert to the tenant's payers, once; returns how many it went to (0: no
    one to tell, already sent, or the alert is gone). Raises lanes.TenantBusy while the
    tenant's previous email is still being sent, OSError when the server refused it."""
    alert = BudgetAlert.objects.select_related("tenant", "budget").filter(pk=alert_id).first()
    if alert is None or alert.emailed_to:
        return 0
    recipients = tenant_payer_emails(alert.tenant_id)
    if not recipients:
        return 0
    subject, body = _message(alert)
    deadline = settings.ATRIUM_EMAIL_TIMEOUT_S
    with lanes.tenant_slot(LANE, alert.tenant_id, cap=1, lease_s=deadline + 5):
        try:
            send_within(subject=subject, body=body, recipients=recipients,
                        deadline_s=deadline)
        except MailTimeout:
            log.warning("budget alert %s: the mail server took longer than %g s", alert_id,
                        deadline)
            raise
    BudgetAlert.objects.filter(pk=alert_id).update(emailed_to=len(recipients))
    return len(recipients)


def _message(alert: BudgetAlert) -> tuple[str, str]:
    event = alert_event(alert.budget, alert)
    end_user = header_text(event["end_user"] or "", limit=64)
    who = {"tenant": "the tenant", "key": f"API key #{event['api_key_id']}",
           "user": f"end user {end_user!r}" if end_user else "each end user"}[event["scope"]]
    reached = ("refused a request or reached its limit" if alert.threshold == 100
               else f"reached {alert.threshold}%")
    subject = f"[Atrium] {alert.tenant.slug}: the {event['window']} budget of {who} {reached}"
    lines = [f"Tenant: {alert.tenant.slug}", f"Budget: #{event['budget_id']} ({who}, per "
             f"{event['window']}, window {event['window_label']})"]
    if event["spend_limit"] is not None:
        lines.append(f"Spend: {event['spent']} of {event['spend_limit']} {event['currency']}")
    if event["token_limit"] is not None:
        lines.append(f"Tokens: {event['tokens']} of {event['token_limit']}")
    if alert.budget.scope == "user" and not alert.budget.end_user:
        lines.append(f"At most {settings.ATRIUM_ALERT_EMAILS_PER_WINDOW} emails per window "
                     "and threshold for this budget; the console and webhooks list every "
                     "end user.")
    return subject, "\n".join(lines) + "\n"
