"""Request logs written before request ids carried their prefix get it: every log's id is
then the completion id its client got (`chatcmpl-…` for chat, `cmpl-…` for completions),
as the logs written since, the ledger and the API show it."""

from django.db import migrations
from django.db.models import F, Q, Value
from django.db.models.functions import Concat

PREFIXES = {"chat": "chatcmpl-", "completion": "cmpl-"}


def prefix_request_ids(apps, schema_editor):
    RequestLog = apps.get_model("requestlogs", "RequestLog")
    bare = RequestLog.objects.exclude(Q(request_id__startswith="chatcmpl-")
                                      | Q(request_id__startswith="cmpl-"))
    for endpoint, prefix in PREFIXES.items():
        bare.filter(endpoint=endpoint).update(request_id=Concat(Value(prefix), F("request_id")))


class Migration(migrations.Migration):

    dependencies = [
        ('requestlogs', '0001_initial'),
    ]

    operations = [
        # NOTE: not reversed: a log's id stays the one its client got.
        migrations.RunPython(prefix_request_ids, migrations.RunPython.noop),
    ]
