# File expiry (expires_after) and what a batch needs of its input file, recorded at upload.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('batches', '0001_initial'),
    ]

    operations = [
        migrations.AddField(
            model_name='file',
            name='endpoints',
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='file',
            name='expires_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name='file',
            index=models.Index(fields=['expires_at'], name='batches_fil_expires_b41812_idx'),
        ),
    ]
