from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0003_bill_past_usage'),
    ]

    operations = [
        migrations.AlterField(
            model_name='usagerecord',
            name='billing_period',
            field=models.DateField(),
        ),
    ]
