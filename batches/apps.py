from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "batches"
    verbose_name = "Files and batches"
    default_auto_field = "django.db.models.BigAutoField"
