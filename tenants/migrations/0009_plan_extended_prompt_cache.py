from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0008_plan_service_tiers'),
    ]

    operations = [
        migrations.AddField(
            model_name='plan',
            name='extended_prompt_cache',
            field=models.BooleanField(default=False),
        ),
    ]
