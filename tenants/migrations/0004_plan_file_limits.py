# Per-plan limits of the Files and Batch APIs (null: the server default).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0003_tenant_plan_required'),
    ]

    operations = [
        migrations.AddField(
            model_name='plan',
            name='max_active_batches',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='plan',
            name='max_file_bytes',
            field=models.PositiveBigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='plan',
            name='max_files',
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
    ]
