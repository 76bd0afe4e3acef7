# A rotated key's lineage: the first key of its rotations, for budgets and key counters.

from django.db import migrations, models
import django.db.models.deletion


def fill_lineages(apps, schema_editor):
    """Keys made by rotations before this field: each replacement takes its first
    ancestor's id, following replaced_by from keys that replace nobody."""
    ApiKey = apps.get_model("tenants", "ApiKey")
    replaced = set(ApiKey.objects.exclude(replaced_by=None).values_list("replaced_by_id",
                                                                       flat=True))
    for root in ApiKey.objects.exclude(replaced_by=None).exclude(pk__in=replaced):
        key, seen = root, {root.pk}
        while key.replaced_by_id is not None and key.replaced_by_id not in seen:
            seen.add(key.replaced_by_id)
            key = ApiKey.objects.get(pk=key.replaced_by_id)
            ApiKey.objects.filter(pk=key.pk).update(lineage_id=root.pk)


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0004_plan_file_limits'),
    ]

    operations = [
        migrations.AddField(
            model_name='apikey',
            name='lineage',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='tenants.apikey'),
        ),
        migrations.RunPython(fill_lineages, migrations.RunPython.noop),
    ]
