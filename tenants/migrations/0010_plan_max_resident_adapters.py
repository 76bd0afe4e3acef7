import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0009_plan_extended_prompt_cache'),
    ]

    operations = [
        migrations.AddField(
            model_name='plan',
            name='max_resident_adapters',
            field=models.PositiveIntegerField(blank=True, null=True, validators=[django.core.validators.MaxValueValidator(100000)]),
        ),
    ]
