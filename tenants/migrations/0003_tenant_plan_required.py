# Every tenant has a plan from 0002 on. Its own migration (and so its own transaction):
# PostgreSQL refuses ALTER TABLE on a table with pending deferred-constraint events.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0002_plans_members_quotas_audit'),
    ]

    operations = [
        migrations.AlterField(
            model_name='tenant',
            name='plan',
            field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='tenants', to='tenants.plan'),
        ),
    ]
